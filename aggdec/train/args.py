"""The training commands' flags, torch-free: `aggdec train ... --help` and a bad flag answer before
torch loads; the training modules (aggdec.train.ar, .heads, .seqkd) take what these return."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

AR_DESCRIPTION = "A compact autoregressive (teacher-forced) Transformer trainer for the project's reference models."
DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
TASKS = {  # name -> (directory, source column, target column)
    "gec": ("gec", "noisy", "clean"),
    "ende": ("ende", "en", "de"),
}


VOCAB_SIZE = 8000
"""Sentencepiece pieces `train ar` trains where --vocab-size is not given (fewer where the text holds fewer)."""


@dataclass
class TrainConfig:
    """A run of aggdec.train.ar: data, model shape, optimisation and budget (each a flag of `ar_config`)."""

    train: str
    valid: str
    src_col: str
    tgt_col: str
    out: str
    recipe: str = ""  # free-form name recorded in meta
    spm_model: str | None = None  # reuse this sentencepiece model; default: train <out>/spm.model
    vocab_size: int | None = None  # None: VOCAB_SIZE, or as many pieces as the text holds where fewer
    init_from: str | None = None  # continue from a saved model directory (its config and spm win)
    rewarmup: int = 100  # with init_from: ramp the (continued) schedule's lr up over this many updates
    # model
    d_model: int = 256
    heads: int = 4
    ffn: int = 1024
    enc_layers: int = 6
    dec_layers: int = 3
    pre_norm: bool = True
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    max_positions: int = 512
    double_token: bool = False  # fold targets into (head, tail) pairs; learned decoder positions
    # optimisation
    max_tokens: int = 4096  # per batch, counting padding: batch_size * max(len) on either side
    lr: float = 1e-3
    warmup: int = 1000
    warmup_init_lr: float = 1e-7
    label_smoothing: float = 0.1
    clip_norm: float = 1.0
    bf16: bool = False  # bfloat16 autocast for the forward pass (CPU with avx512_bf16/AMX, or CUDA)
    device: str = "cpu"  # "cpu" or "cuda" (checkpoints are saved the same either way)
    # budget and bookkeeping
    max_minutes: float = 60.0
    max_updates: int = 0  # 0 = unlimited
    seed: int = 1
    threads: int = 1
    log_interval: int = 50  # updates
    eval_minutes: float = 5.0  # validate (and save if better) this often, and at the end
    eval_updates: int = 0  # ... or every this many updates (0 = off)



AR_HELP = {
    "train": "training pairs: a TSV file with a header line", "valid": "validation pairs: a TSV file as --train",
    "src_col": "the source column of --train and --valid", "tgt_col": "the target column",
    "out": "the model directory to write", "recipe": "a free-form name recorded in the model's metadata",
    "spm_model": "reuse this sentencepiece model (default: train OUT/spm.model on the training text)",
    "vocab_size": f"sentencepiece pieces to train (default: {VOCAB_SIZE}, or as many as the training text holds "
                  "where it holds fewer; more than it holds is an error)",
    "init_from": "continue from a saved model directory (its configuration and sentencepiece model win)",
    "rewarmup": "with --init-from: updates over which the continued learning rate ramps up again",
    "d_model": "model width", "heads": "attention heads", "ffn": "feed-forward width",
    "enc_layers": "encoder layers", "dec_layers": "decoder layers", "pre_norm": "normalize before each sublayer",
    "dropout": "dropout after sublayers and embeddings", "attention_dropout": "dropout of attention weights",
    "activation_dropout": "dropout inside the feed-forward layer", "max_positions": "longest sequence, in pieces",
    "double_token": "fold targets into (head, tail) pairs: a double-token model (learned decoder positions)",
    "max_tokens": "tokens a batch holds, padding counted (batch size x longest side)",
    "lr": "peak learning rate (inverse square root schedule)", "warmup": "updates of linear warm-up",
    "warmup_init_lr": "learning rate at the first update", "label_smoothing": "label smoothing of the loss",
    "clip_norm": "gradient norm clipping", "bf16": "bfloat16 autocast for the forward pass (AMX/AVX512-BF16 or CUDA)",
    "device": "cpu or cuda (checkpoints are saved alike)", "max_minutes": "training time budget",
    "max_updates": "stop after this many updates (0: no limit)", "seed": "random seed", "threads": "CPU threads",
    "log_interval": "updates between log lines", "eval_minutes": "validate (and save if better) this often, and at the end",
    "eval_updates": "or every this many updates (0: off)",
}
"""Each `TrainConfig` field's help text (`ar_parser`)."""


def ar_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m aggdec.train.ar", description=AR_DESCRIPTION)
    p.add_argument("--task", choices=sorted(TASKS),
                   help="preset columns and files TASK/train.tsv, TASK/valid.tsv under --data-dir (the project's corpora)")
    p.add_argument("--data-dir", default=str(DATA), help="where --task finds its files (default: ../shared/data "
                                                           "beside the source tree)")
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for name, f in fields.items():
        flag = "--" + name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=AR_HELP[name])
        else:
            typ = {"int": int, "int | None": int, "float": float}.get(str(f.type), str)
            default = None if f.default is dataclasses.MISSING else f.default
            p.add_argument(flag, type=typ, default=default,
                           help=AR_HELP[name] + ("" if default in (None, "") else " (default: %(default)s)"))
    return p


def _missing_data(name: str, path: str, task: str | None, data_dir: Path) -> str:
    """One line naming the missing --train/--valid file and how to give data (the presets read the
    project's own corpora, which a copy of the package does not hold)."""
    own = "--train FILE --valid FILE --src-col COL --tgt-col COL (TSV files with a header line)"
    if task:
        sub = TASKS[task][0]
        return (f"--task {task}: {path} not found; the preset reads {sub}/train.tsv and {sub}/valid.tsv under "
                f"--data-dir (default {data_dir}): pass --data-dir DIR, or your own data with {own}")
    return f"--{name}: {path} not found; give {own}"


def ar_config(argv: list[str] | None = None) -> TrainConfig:
    """`python -m aggdec.train.ar`'s flags as a TrainConfig; SystemExit with one line for a missing flag
    or data file (and, for --help, after printing the help)."""
    args = vars(ar_parser().parse_args(argv))
    task, data_dir = args.pop("task"), Path(args.pop("data_dir"))
    if task:
        sub, s_col, t_col = TASKS[task]
        args["train"] = args["train"] or str(data_dir / sub / "train.tsv")
        args["valid"] = args["valid"] or str(data_dir / sub / "valid.tsv")
        args["src_col"] = args["src_col"] or s_col
        args["tgt_col"] = args["tgt_col"] or t_col
    missing = [k for k in ("train", "valid", "src_col", "tgt_col", "out") if not args[k]]
    if missing:
        raise SystemExit(f"missing --{', --'.join(m.replace('_', '-') for m in missing)} (or use --task)")
    for name in ("train", "valid"):
        if not Path(args[name]).is_file():
            raise SystemExit(_missing_data(name, args[name], task, data_dir))
    if not args["recipe"]:
        args["recipe"] = "python -m aggdec.train.ar " + " ".join(sys.argv[1:] if argv is None else argv)
    return TrainConfig(**args)


def heads_args(argv: list[str] | None = None) -> argparse.Namespace:
    """`python -m aggdec.train.heads`'s flags; SystemExit for a bad one (and after --help)."""
    ap = argparse.ArgumentParser(prog="python -m aggdec.train.heads", description="Train blockwise proposal heads "
                                 "(Stern et al. 2018) on a frozen verifier, on Seq-KD data.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--verifier", required=True, help="the model directory whose heads these are (kept frozen)")
    ap.add_argument("--data", required=True, help="Seq-KD TSV (see aggdec.train.seqkd)")
    ap.add_argument("--src-col", default="src", help="source column of --data")
    ap.add_argument("--tgt-col", default="kd", help="target column of --data: the verifier's own outputs")
    ap.add_argument("--out", required=True, help="directory to write the heads to")
    ap.add_argument("--block-size", type=int, default=4, help="k: k - 1 heads")
    ap.add_argument("--hidden", type=int, default=512, help="FFN width of each head")
    ap.add_argument("--max-tokens", type=int, default=4096, help="tokens a batch holds, padding counted")
    ap.add_argument("--lr", type=float, default=5e-4, help="peak learning rate (inverse square root schedule)")
    ap.add_argument("--warmup", type=int, default=500, help="updates of linear warm-up")
    ap.add_argument("--label-smoothing", type=float, default=0.1, help="label smoothing of the loss")
    ap.add_argument("--max-minutes", type=float, default=30, help="training time budget")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads")
    ap.add_argument("--seed", type=int, default=1, help="random seed")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--bf16", action="store_true", help="bfloat16 autocast for forward passes")
    ap.add_argument("--pad-multiple", type=int, default=8, help="round batch widths up to this (GPU shape reuse)")
    ap.add_argument("--log-interval", type=int, default=50, help="updates between log lines")
    a = ap.parse_args(argv)
    if a.block_size < 2:
        raise SystemExit("--block-size must be >= 2")
    return a


def seqkd_args(argv: list[str] | None = None) -> argparse.Namespace:
    """`python -m aggdec.train.seqkd`'s flags; SystemExit for a bad one (and after --help)."""
    ap = argparse.ArgumentParser(prog="python -m aggdec.train.seqkd", description="Seq-KD data: a model's own "
                                 "greedy (or beam) outputs on training sources.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", required=True, help="the model directory whose outputs are the data (the teacher)")
    ap.add_argument("--data", required=True, help="TSV with a header line")
    ap.add_argument("--column", required=True, help="source column")
    ap.add_argument("--out", required=True, help="the TSV to write (columns src, kd)")
    ap.add_argument("--limit", type=int, default=0, help="decode only the first this many sources (0: all)")
    ap.add_argument("--method", default="greedy", choices=["greedy", "beam"], help="decoding method")
    ap.add_argument("--batch-size", type=int, default=64, help="sentences decoded at once")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (fp32 either way)")
    return ap.parse_args(argv)
