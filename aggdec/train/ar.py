"""A compact autoregressive (teacher-forced) Transformer trainer for the project's reference models.

Reads a TSV (header line, tab-separated, no quoting), trains (or reuses) a joint sentencepiece model
on both sides, encodes the data once, batches it by length into token-bounded batches and trains
with Adam(0.9, 0.98), an inverse-sqrt schedule with linear warmup, label-smoothed cross entropy and
gradient clipping. The model is saved in the project format (`aggdec.bundle.save`) whenever the
validation loss improves, so a run stopped at any time leaves a usable model.

    python -m aggdec.train.ar --task gec --out models/gec-base --max-minutes 75

With `--double-token` the model learns double-token bidirectional decoding (aggdec.double_token):
targets are folded into (head, tail) pairs and the decoder's positions are learned. From
`--init-from` a single-token model, every weight is kept and the learned positions start as its
sinusoidal table.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from aggdec import checkpoint
from aggdec.bundle import save
from aggdec.double_token import teacher_forcing
from aggdec.model.config import ModelConfig
from aggdec.model.transformer import Transformer
from aggdec.tokenizers import SentencePieceTokenizer
from aggdec.train.args import VOCAB_SIZE, TrainConfig, ar_config
from aggdec.train.spm import train_sentencepiece

BOS, PAD, EOS = 0, 1, 2


# -- data ----------------------------------------------------------------------------------------

def read_tsv(path: str | Path, src_col: str, tgt_col: str) -> tuple[list[str], list[str]]:
    csv.field_size_limit(1 << 30)
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader)
        try:
            si, ti = header.index(src_col), header.index(tgt_col)
        except ValueError:
            raise ValueError(f"{path}: columns {src_col!r}/{tgt_col!r} not in header {header}") from None
        src, tgt = [], []
        for row in reader:
            src.append(row[si])
            tgt.append(row[ti])
    return src, tgt


def encode_pairs(tok: SentencePieceTokenizer, src: list[str], tgt: list[str], max_pos: int):
    """-> (src ids, tgt ids) without eos, dropping pairs that are empty or do not fit max_pos with eos."""
    s_ids = tok.sp.encode(src, num_threads=1)
    t_ids = tok.sp.encode(tgt, num_threads=1)
    keep = [i for i in range(len(s_ids)) if 0 < len(s_ids[i]) < max_pos and 0 < len(t_ids[i]) < max_pos]
    return [np.asarray(s_ids[i], dtype=np.int32) for i in keep], [np.asarray(t_ids[i], dtype=np.int32) for i in keep]


def make_batches(src, tgt, max_tokens: int, rng: random.Random | None) -> list[list[int]]:
    """Length-bucketed batches of indices: bsz * max(len+1 over both sides) <= max_tokens."""
    n = len(src)
    slen = np.fromiter((len(s) for s in src), dtype=np.int64, count=n) + 1
    tlen = np.fromiter((len(t) for t in tgt), dtype=np.int64, count=n) + 1
    tie = np.array([rng.random() for _ in range(n)]) if rng is not None else np.arange(n)
    order = np.lexsort((tie, slen, tlen))  # by target length, then source length
    batches, cur, width = [], [], 0
    for i in order.tolist():
        w = max(width, int(slen[i]), int(tlen[i]))
        if cur and w * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, w = [], max(int(slen[i]), int(tlen[i]))
        cur.append(i)
        width = w
    if cur:
        batches.append(cur)
    if rng is not None:
        rng.shuffle(batches)
    return batches


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def collate(src, tgt, idx: list[int], multiple: int = 1, double_token: bool = False):
    """-> src (B,S) [tokens, eos], prev (B,T) [eos, tokens], target (B,T) [tokens, eos]; right-padded,
    widths rounded up to `multiple` (fewer distinct shapes for GPU kernels and allocator).
    double_token: target is the folded sentence (aggdec.double_token.fold) and prev is
    [bos, eos, target[:-2]]: each pair is predicted from the pairs before it."""
    b = len(idx)
    pairs = [teacher_forcing(list(tgt[i]), BOS, EOS, EOS) for i in idx] if double_token else None
    s_w = round_up(max(len(src[i]) for i in idx) + 1, multiple)
    t_w = round_up(max(len(z) for _, z in pairs) if pairs else max(len(tgt[i]) for i in idx) + 1, multiple)
    s = np.full((b, s_w), PAD, dtype=np.int64)
    prev = np.full((b, t_w), PAD, dtype=np.int64)
    target = np.full((b, t_w), PAD, dtype=np.int64)
    for r, i in enumerate(idx):
        a, t = src[i], tgt[i]
        s[r, : len(a)] = a
        s[r, len(a)] = EOS
        if pairs:
            p, z = pairs[r]
            prev[r, : len(p)] = p
            target[r, : len(z)] = z
        else:
            prev[r, 0] = EOS
            prev[r, 1 : len(t) + 1] = t
            target[r, : len(t)] = t
            target[r, len(t)] = EOS
    return torch.from_numpy(s), torch.from_numpy(prev), torch.from_numpy(target)


def to_double_token(model: Transformer) -> Transformer:
    """A double-token model initialised from single-token `model`: every weight kept, the decoder's
    positions learned and starting as `model`'s position table."""
    cfg = dataclasses.replace(model.cfg, double_token=True, dec_learned_pos=True)
    out = Transformer(cfg).to(next(model.parameters()).device)
    missing, unexpected = out.load_state_dict(model.state_dict(), strict=False)
    if unexpected or set(missing) - {"decoder.embed_positions.weight"}:
        raise ValueError(f"cannot convert: missing {missing}, unexpected {unexpected}")
    old = model.decoder.embed_positions
    with torch.no_grad():
        out.decoder.embed_positions.weight.copy_(old.weight if old.learned else old.table)
    return out


def training_autocast(device: str, bf16: bool) -> torch.autocast:
    """The forward passes' autocast context for `device` (bfloat16 when `bf16`; reusable, not nestable).

    On CUDA this also turns off cuDNN's scaled-dot-product attention: it plans a graph for every new
    batch shape, so the first few hundred updates run several times slower until the shapes were seen.
    """
    kind = torch.device(device).type
    if kind == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
    return torch.autocast(kind, dtype=torch.bfloat16, enabled=bf16)


def to_device(tensors: tuple[torch.Tensor, ...], device: str | torch.device) -> tuple[torch.Tensor, ...]:
    """Move a collated batch to `device` (a no-op on CPU). Pageable copies: pinning a fresh buffer
    for every new batch shape costs more than the copy saves."""
    if torch.device(device).type == "cpu":
        return tensors
    return tuple(t.to(device) for t in tensors)


# -- model, loss, schedule -----------------------------------------------------------------------

def init_weights(model: Transformer) -> None:
    """fairseq-style init: xavier-uniform linear weights (q/k/v with gain 1/sqrt 2), zero biases."""
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            gain = 2**-0.5 if name.endswith(("q_proj", "k_proj", "v_proj")) else 1.0
            nn.init.xavier_uniform_(mod.weight, gain=gain)
            if mod.bias is not None:
                nn.init.zeros_(mod.bias)


def ls_loss(logits: torch.Tensor, target: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Label-smoothed CE summed over non-pad targets -> (loss, nll, ntokens), fairseq's formula."""
    lprobs = F.log_softmax(logits.float(), dim=-1).view(-1, logits.shape[-1])
    target = target.reshape(-1)
    mask = target.ne(PAD)
    nll = -lprobs.gather(1, target[:, None]).squeeze(1)
    smooth = -lprobs.sum(dim=-1)
    nll = nll.masked_fill(~mask, 0.0).sum()
    smooth = smooth.masked_fill(~mask, 0.0).sum()
    loss = (1.0 - eps) * nll + eps / lprobs.shape[-1] * smooth
    return loss, nll, int(mask.sum())


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.warmup_init_lr + (cfg.lr - cfg.warmup_init_lr) * step / cfg.warmup
    return cfg.lr * math.sqrt(cfg.warmup / max(step, 1))


@torch.no_grad()
def evaluate(model: Transformer, src, tgt, batches, cfg: TrainConfig) -> tuple[float, float]:
    """-> (label-smoothed loss, nll) per target token, in nats."""
    model.eval()
    tot_loss = tot_nll = 0.0
    ntok = 0
    amp = training_autocast(cfg.device, cfg.bf16)
    for idx in batches:
        s, prev, target = to_device(collate(src, tgt, idx, double_token=cfg.double_token), cfg.device)
        with amp:
            logits = model(s, prev)
        loss, nll, n = ls_loss(logits, target, cfg.label_smoothing)
        tot_loss += float(loss)
        tot_nll += float(nll)
        ntok += n
    model.train()
    return tot_loss / max(ntok, 1), tot_nll / max(ntok, 1)


# -- training ------------------------------------------------------------------------------------

def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def train_ar(cfg: TrainConfig) -> Path:
    """Train per `cfg`; returns the output model directory (saved at each validation improvement)."""
    t_start = time.time()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    log(f"config {json.dumps(dataclasses.asdict(cfg))}")

    tr_src, tr_tgt = read_tsv(cfg.train, cfg.src_col, cfg.tgt_col)
    va_src, va_tgt = read_tsv(cfg.valid, cfg.src_col, cfg.tgt_col)
    log(f"read {len(tr_src)} train / {len(va_src)} valid rows")

    # tokenizer and model
    prior_updates, prior_minutes, prior_epochs = 0, 0.0, 0.0
    if cfg.init_from:
        bundle = checkpoint.load(cfg.init_from)
        model = bundle.model.float()
        mcfg = model.cfg
        spm_path = Path(cfg.init_from) / "spm.model"
        prior_updates = int(bundle.meta.get("updates", 0))
        prior_minutes = float(bundle.meta.get("minutes", 0.0))
        prior_epochs = float(bundle.meta.get("epochs", 0.0))
        log(f"init from {cfg.init_from} ({prior_updates} updates, {prior_minutes:.1f} min)")
        if cfg.double_token and not mcfg.double_token:
            model = to_double_token(model)
            mcfg = model.cfg
            log("converted to a double-token model (learned decoder positions from the position table)")
    else:
        spm_path = Path(cfg.spm_model) if cfg.spm_model else out / "spm.model"
        if not spm_path.is_file():
            t0 = time.time()
            prefix = spm_path.with_suffix("")
            train_sentencepiece(tr_src + tr_tgt, prefix, cfg.vocab_size or VOCAB_SIZE, at_most=cfg.vocab_size is None)
            prefix.with_suffix(".vocab").unlink(missing_ok=True)
            log(f"trained sentencepiece {spm_path} (vocab {len(SentencePieceTokenizer(spm_path))}) in "
                f"{time.time() - t0:.0f}s")
        tok = SentencePieceTokenizer(spm_path)
        mcfg = ModelConfig(
            src_vocab=len(tok), tgt_vocab=len(tok), d_model=cfg.d_model,
            enc_layers=cfg.enc_layers, dec_layers=cfg.dec_layers, enc_heads=cfg.heads, dec_heads=cfg.heads,
            enc_ffn=cfg.ffn, dec_ffn=cfg.ffn, enc_normalize_before=cfg.pre_norm, dec_normalize_before=cfg.pre_norm,
            share_all_embeddings=True, dropout=cfg.dropout, attention_dropout=cfg.attention_dropout,
            activation_dropout=cfg.activation_dropout,
            max_source_positions=cfg.max_positions, max_target_positions=cfg.max_positions,
            dec_learned_pos=cfg.double_token, double_token=cfg.double_token,
        )
        model = Transformer(mcfg)
        init_weights(model)
    model = model.to(cfg.device)
    amp = training_autocast(cfg.device, cfg.bf16)
    tok = SentencePieceTokenizer(spm_path)
    max_pos = min(mcfg.max_source_positions, mcfg.max_target_positions)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model {json.dumps(mcfg.to_dict())} params={n_params}")

    t0 = time.time()
    tr_src_ids, tr_tgt_ids = encode_pairs(tok, tr_src, tr_tgt, max_pos)
    va_src_ids, va_tgt_ids = encode_pairs(tok, va_src, va_tgt, max_pos)
    n_src_tok = sum(len(s) + 1 for s in tr_src_ids)
    n_tgt_tok = sum(len(t) + 1 for t in tr_tgt_ids)
    log(f"encoded in {time.time() - t0:.0f}s: train {len(tr_src_ids)} pairs kept of {len(tr_src)} "
        f"({n_src_tok} src / {n_tgt_tok} tgt tokens incl. eos), valid {len(va_src_ids)} of {len(va_src)}")
    va_batches = make_batches(va_src_ids, va_tgt_ids, cfg.max_tokens, None)

    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), eps=1e-8)
    model.train()

    best = float("inf")
    step = prior_updates  # global update count (the schedule continues across --init-from)
    updates = 0
    epoch = 0
    tgt_seen = 0
    t_train = time.time()
    t_eval = t_train
    win = {"loss": 0.0, "nll": 0.0, "tok": 0, "src": 0, "t": time.time(), "cpu": time.process_time()}
    deadline = t_train + 60.0 * cfg.max_minutes

    def validate_and_save(reason: str) -> None:
        nonlocal best
        v_loss, v_nll = evaluate(model, va_src_ids, va_tgt_ids, va_batches, cfg)
        minutes = (time.time() - t_train) / 60.0
        improved = v_nll < best
        log(f"valid | update {step} | epoch {tgt_seen / n_tgt_tok:.2f} | loss {v_loss:.4f} | nll {v_nll:.4f} "
            f"| ppl {math.exp(v_nll):.2f} | {minutes:.1f} min | {reason}{' | saved' if improved else ''}")
        if improved:
            best = v_nll
            meta = {
                "recipe": cfg.recipe or f"aggdec.train.ar {Path(cfg.train).parent.name}",
                "data": {"train": str(cfg.train), "valid": str(cfg.valid), "src": cfg.src_col, "tgt": cfg.tgt_col,
                         "train_pairs": len(tr_src_ids)},
                "updates": step,
                "epochs": round(prior_epochs + tgt_seen / n_tgt_tok, 3),
                "minutes": round(prior_minutes + minutes, 2),
                "valid_loss": round(v_loss, 4),
                "valid_nll": round(v_nll, 4),
                "train_config": dataclasses.asdict(cfg),
            }
            if cfg.init_from:
                meta["init_from"] = {"path": str(cfg.init_from), "updates": prior_updates, "minutes": prior_minutes}
            save(out, model, tokenizer={"type": "sentencepiece", "src": "spm.model", "tgt": "spm.model"},
                            files={"spm.model": spm_path}, dtype=torch.float16, meta=meta)

    stop = False
    while not stop:
        epoch += 1
        for idx in make_batches(tr_src_ids, tr_tgt_ids, cfg.max_tokens, rng):
            s, prev, target = to_device(collate(tr_src_ids, tr_tgt_ids, idx, double_token=cfg.double_token),
                                        cfg.device)
            step += 1
            updates += 1
            lr = lr_at(step, cfg)
            if cfg.init_from and cfg.rewarmup > 0:  # fresh Adam moments: ease back in
                lr *= min(1.0, updates / cfg.rewarmup)
            for g in opt.param_groups:
                g["lr"] = lr
            with amp:
                logits = model(s, prev)
            loss, nll, ntok = ls_loss(logits, target, cfg.label_smoothing)
            opt.zero_grad(set_to_none=True)
            (loss / ntok).backward()
            if cfg.clip_norm > 0:
                nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
            opt.step()
            tgt_seen += ntok
            win["loss"] += float(loss.detach())
            win["nll"] += float(nll.detach())
            win["tok"] += ntok
            win["src"] += int(s.ne(PAD).sum())
            now = time.time()
            if updates % cfg.log_interval == 0:
                dt = now - win["t"]
                cpu = time.process_time() - win["cpu"]
                wl, wn = win["loss"] / win["tok"], win["nll"] / win["tok"]
                log(f"train | update {step} | epoch {tgt_seen / n_tgt_tok:.2f} | loss {wl:.4f} | nll {wn:.4f} "
                    f"| ppl {math.exp(wn):.2f} | lr {lr:.2e} | tgt tok/s {win['tok'] / dt:.0f} "
                    f"| src+tgt tok/s {(win['tok'] + win['src']) / dt:.0f} | cpu {100 * cpu / dt:.0f}% "
                    f"| {(now - t_train) / 60:.1f} min")
                win = {"loss": 0.0, "nll": 0.0, "tok": 0, "src": 0, "t": now, "cpu": time.process_time()}
            if now >= deadline or (cfg.max_updates and updates >= cfg.max_updates):
                stop = True
                break
            if (now - t_eval >= 60.0 * cfg.eval_minutes) or (cfg.eval_updates and updates % cfg.eval_updates == 0):
                validate_and_save(f"interval (epoch {epoch})")
                t_eval = time.time()
    validate_and_save("end")
    log(f"done: {updates} updates this run ({step} total), {tgt_seen / n_tgt_tok:.2f} epochs, "
        f"{(time.time() - t_train) / 60:.1f} min training, {(time.time() - t_start) / 60:.1f} min total; "
        f"best valid nll {best:.4f} -> {out}")
    return out


# -- command line --------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    """Command-line entry (flags: aggdec.train.args.ar_config); returns 0 (an exit status) once the
    model is saved."""
    train_ar(ar_config(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
