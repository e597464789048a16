"""`compare`: systems x models x batch sizes on one device, and `contention`: the same systems beside
competing processes.

Each system runs in a process of its own (bench/systems.py) kept for the whole run, or for each of
`--processes` rounds (fresh processes each, the systems interleaved, each round from the next one on); the
repeats go round every batch size and system in turn, and each figure is the median of a system's repeats
(of every process). With `--cold`, `first_sentences_per_s` lists each process's first call at each batch
size.
A `/best` system stands for its layouts (bench/systems.py), timed as systems of their own; after
them, `compare` records per batch size a run under the `/best` name: the fastest layout's figures,
with `best` (its system), `layout` and `layouts` (every layout's sentences/s).
Outputs are token ids, and each run's identical share is taken against the reference system
(`--reference`, one of the systems) on the same model at the same batch size, in the same run, over
each sentence's first `limit` tokens: aggdec's length rule (`--max-new` N, or the decode options'
max_len_a * src_len + max_len_b) stops an output after `limit` tokens, while transformers' `generate`
runs to `max_new_tokens` = the batch's largest limit + 1 (as many decoder steps as aggdec's, whose
last one can only give eos), so an output that reaches its limit is compared on those tokens, and
one that ends earlier must end at the same token on both sides.
The parent prepares what the peers need, outside any timing: token pieces for CTranslate2 and
fairseq, the CTranslate2 conversion, the fairseq export and its binarized inputs, made once per
model under `--work`.

Models of published models' shapes with random weights, built on the spot: the names `--model` of
`compare` and `roofline` takes besides model directories (nothing downloaded, nothing kept in git).

`SHAPES` maps each name to its transformers config (the published model's dimensions) and its builder,
which saves the model with `save_pretrained` and a tokenizer of the model's kind trained on the
benchmark's sources (the first `TEXTS` of `--data`'s column, up to `PIECES` sentencepiece pieces); the
weights are seeded, so the same name and sources give the same model.

- opus-mt-shaped: Marian, opus-mt-en-de's shape (6+6 layers, d_model 512, 8 heads, FFN 2048, swish,
  58,101 tokens: vocab.json padded with unused tokens), init std 0.1: every output runs to the limit.
- t5-base-shaped: T5 v1.0 base (12+12 layers, d_model 768, 12 heads of d_kv 64, FFN 3072, ReLU, 32,128
  embedding rows tied to the output, about 223M parameters); T5's tokenizer and weights as
  models/make_t5.py makes them.
- m2m100-shaped: M2M100-418M (12+12 layers, d_model 1024, 16 heads, FFN 4096, ReLU, scaled embeddings,
  128,112 rows tied to the output, about 484M parameters, which the name counts without the
  embedding's 131M); M2M100Tokenizer's files, vocab.json padded with unused tokens to the real model's
  128,004 entries, so that its 100 language tokens and 8 "madeup words" have their real ids; the
  source is __en__ text </s>, the output starts with __de__ (forced: `generation_config`'s
  forced_bos_token_id for transformers, aggdec's conventions, CTranslate2's target prefix).

The T5 and M2M100 shapes write text pieces only (`text_pieces_only`): the embedding row of every other
token is zero, so its logit under the tied output projection is 0, below the largest of thousands of
random logits. Their outputs thus run to `--max-new` (eos is never written) and are comparable between
systems: no pad (aggdec never writes it, the peers would) and no row CTranslate2's vocabulary names
otherwise than the tokenizer (T5's rows past the tokenizer, M2M100's madeup words).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple

from bench.record import REPO, Results, shown
from bench.systems import START_ENV, Process, System

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

TEXTS = 5000  # sources a shape's tokenizer is trained on
PIECES = 8000  # sentencepiece pieces at most (fewer where the sources have not that many)
OPUS_MT = dict(vocab_size=58101, decoder_vocab_size=58101, d_model=512, encoder_layers=6, decoder_layers=6,
               encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048,
               max_position_embeddings=512, activation_function="swish", scale_embedding=True, pad_token_id=58100,
               eos_token_id=0, decoder_start_token_id=58100, forced_eos_token_id=0)
T5_BASE = dict(vocab_size=32128, d_model=768, d_kv=64, num_heads=12, num_layers=12, num_decoder_layers=12, d_ff=3072,
               feed_forward_proj="relu", tie_word_embeddings=True)
M2M100_418M = dict(vocab_size=128112, d_model=1024, encoder_layers=12, decoder_layers=12, encoder_attention_heads=16,
                   decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096, activation_function="relu",
                   scale_embedding=True, max_position_embeddings=1024, bos_token_id=0, pad_token_id=1, eos_token_id=2,
                   decoder_start_token_id=2, tie_word_embeddings=True)
M2M100_ENTRIES = 128004  # vocab.json's entries in M2M100-418M; the language tokens and madeup words follow
M2M100_LANGS = ("en", "de")  # source, target


class Shape(NamedTuple):
    config: Callable[[], PretrainedConfig]  # -> the shape's transformers config
    build: Callable[[PretrainedConfig, Path, list[str]], None]  # (config, folder, texts): model and tokenizer saved


def train_spm(texts: list[str], prefix: Path, **special_ids: int) -> Path:
    """A unigram sentencepiece model of up to PIECES pieces trained on `texts` -> prefix.model (and .vocab)."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_prefix=str(prefix), vocab_size=PIECES,
                                   hard_vocab_limit=False, model_type="unigram", character_coverage=1.0,
                                   minloglevel=2, num_threads=2, **special_ids)
    return prefix.with_suffix(".model")


def padded(vocab: dict[str, int], size: int) -> dict[str, int]:
    """`vocab` (ids 0 .. len - 1) with unused tokens <unusedI> at ids len .. size - 1."""
    return {**vocab, **{f"<unused{i}>": i for i in range(len(vocab), size)}}


def text_pieces_only(embedding: torch.Tensor, pieces: range) -> None:
    """Zero every row of a tied `embedding` outside `pieces`: those tokens' logits are 0, never the
    largest (module docstring)."""
    import torch

    with torch.no_grad():
        embedding[: pieces.start] = 0.0
        embedding[pieces.stop:] = 0.0


def marian_config() -> PretrainedConfig:
    from transformers import MarianConfig

    return MarianConfig(**OPUS_MT, init_std=0.1)


def build_marian(cfg: PretrainedConfig, out: Path, texts: list[str]) -> None:
    """OPUS-MT's files: source.spm = target.spm, vocab.json (</s> 0, <unk> 1, the pieces, unused tokens,
    <pad> last)."""
    import sentencepiece as spm
    import torch
    from transformers import MarianMTModel, MarianTokenizer

    model_file = train_spm(texts, out / "spm")
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    pieces = [p for p in (sp.id_to_piece(i) for i in range(sp.get_piece_size())) if p not in ("<unk>", "<s>", "</s>")]
    vocab = padded({"</s>": 0, "<unk>": 1, **{p: i + 2 for i, p in enumerate(pieces)}}, cfg.vocab_size - 1)
    vocab["<pad>"] = cfg.vocab_size - 1
    for name in ("source.spm", "target.spm"):
        (out / name).write_bytes(model_file.read_bytes())
    (out / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    torch.manual_seed(0)
    MarianMTModel(cfg).save_pretrained(out)
    MarianTokenizer(str(out / "source.spm"), str(out / "target.spm"), str(out / "vocab.json")).save_pretrained(out)


def t5_config() -> PretrainedConfig:
    from models.make_t5 import config

    return config(T5_BASE)


def build_t5(cfg: PretrainedConfig, out: Path, texts: list[str]) -> None:
    """T5's tokenizer (models/make_t5.py: pad 0, </s> 1, <unk> 2, the pieces, 100 sentinels) and weights."""
    from models.make_t5 import EXTRA_IDS, random_t5, tokenizer

    tok = tokenizer(texts, out, PIECES)
    if len(tok) > cfg.vocab_size:
        raise ValueError(f"the tokenizer has {len(tok)} entries, more than the model's {cfg.vocab_size} rows")
    model = random_t5(cfg, seed=0, tied=T5_BASE["tie_word_embeddings"])
    text_pieces_only(model.shared.weight, range(3, len(tok) - EXTRA_IDS))
    model.save_pretrained(out)


def m2m100_config() -> PretrainedConfig:
    from transformers import M2M100Config

    return M2M100Config(**M2M100_418M, init_std=0.1)


def build_m2m100(cfg: PretrainedConfig, out: Path, texts: list[str]) -> None:
    """M2M100Tokenizer's files: sentencepiece.bpe.model and vocab.json (<s> 0, <pad> 1, </s> 2, <unk> 3,
    the pieces, unused tokens to M2M100_ENTRIES), English to German."""
    import sentencepiece as spm
    import torch
    from transformers import M2M100ForConditionalGeneration, M2M100Tokenizer
    from transformers.models.m2m_100.tokenization_m2m_100 import FAIRSEQ_LANGUAGE_CODES

    model_file = train_spm(texts, out / "spm", bos_id=0, pad_id=1, eos_id=2, unk_id=3)
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    vocab = padded({sp.id_to_piece(i): i for i in range(sp.get_piece_size())}, M2M100_ENTRIES)
    model_file.rename(out / "sentencepiece.bpe.model")
    (out / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    source, target = M2M100_LANGS
    # the language tokens listed as special tokens, as the hub's files list them: otherwise transformers 5's
    # M2M100Tokenizer leaves them out of get_vocab(), whence CTranslate2's converter takes the vocabulary
    languages = [f"__{code}__" for code in FAIRSEQ_LANGUAGE_CODES["m2m100"]]
    tok = M2M100Tokenizer(str(out / "vocab.json"), str(out / "sentencepiece.bpe.model"), src_lang=source,
                          tgt_lang=target, additional_special_tokens=languages)
    rows = len(tok.encoder) + len(tok.lang_token_to_id) + tok.num_madeup_words
    if rows != cfg.vocab_size:
        raise ValueError(f"the tokenizer has {rows} entries, the model {cfg.vocab_size} rows")
    torch.manual_seed(0)
    model = M2M100ForConditionalGeneration(cfg)
    text_pieces_only(model.model.shared.weight, range(4, sp.get_piece_size()))
    model.generation_config.forced_bos_token_id = tok.get_lang_id(target)
    model.save_pretrained(out)
    tok.save_pretrained(out)


SHAPES = {"opus-mt-shaped": Shape(marian_config, build_marian), "t5-base-shaped": Shape(t5_config, build_t5),
          "m2m100-shaped": Shape(m2m100_config, build_m2m100)}


def build(name: str, texts: list[str], work: Path) -> Path:
    """Shape `name`'s directory with a tokenizer trained on `texts`: work/NAME-LEN(TEXTS), built unless it
    is there (built beside it and renamed, so that a directory there is whole)."""
    out = work / f"{name}-{len(texts)}"
    if not out.is_dir():
        part = work / f"{out.name}.part"
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
        shape = SHAPES[name]
        shape.build(shape.config(), part, texts)
        part.rename(out)
    return out


def resolve(model: str, data: Path, column: str, work: Path) -> Path:
    """`model` as a model directory: a shape's name is built under `work` (`build`, on the first TEXTS
    sources of `data`'s `column`); anything else is a path."""
    if model not in SHAPES:
        return Path(model)
    from aggdec.train.ar import read_tsv

    return build(model, read_tsv(data, column, column)[0][:TEXTS], work)


COMPETITOR = """import sys, torch
torch.set_num_threads(int(sys.argv[1]))
a = torch.randn(1024, 1024)
a @ a
print("ready", flush=True)
while True:
    a @ a
"""


def add_arguments(ap: argparse.ArgumentParser, systems: str) -> None:
    """The options `compare` and `contention` share."""
    ap.add_argument("--model", default="models/gec-base",
                    help="default model of the systems: a model directory, or a shape built with random weights: "
                         + ", ".join(SHAPES) + " (`SHAPES`)")
    ap.add_argument("--data", type=Path, required=True, help="a TSV file with a header line")
    ap.add_argument("--column", default="noisy", help="the source column")
    ap.add_argument("--ref-column", default=None, help="the reference column: BLEU and chrF of every run")
    ap.add_argument("--prefix", default="", help="text put before every source (a task prefix, as T5 models take)")
    ap.add_argument("--systems", default=systems, help="comma-separated systems (bench/systems.py)")
    ap.add_argument("--reference", default="greedy", help="the system whose outputs the others are compared with")
    ap.add_argument("--also-identical", default="", metavar="SYSTEMS",
                    help="comma-separated systems every run is also compared with (identical_to_SYSTEM)")
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--limit", type=int, default=None, help="first N sentences (default: all)")
    ap.add_argument("--bs1-limit", type=int, default=200, help="first N sentences at batch size 1")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cold", action="store_true",
                    help="aggdec systems time their first call at each batch size too (no warm-up decode): the first "
                         "repeat is a fresh process's first call, later ones follow on its Translator")
    ap.add_argument("--processes", type=int, default=1,
                    help="rounds of fresh processes: every system's process is started anew for each, and runs "
                         "--repeat repeats")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--drafter", default="models/ende-base-draft-head", help="gad and gad++: the draft head")
    ap.add_argument("--heads", default="models/ende-base-heads", help="blockwise: the proposal heads")
    ap.add_argument("--beam", type=int, default=5, help="beam size of beam and *-beam systems")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a decode option of every aggdec system (JSON value), repeatable")
    ap.add_argument("--max-new", type=int, default=None,
                    help="every output at most N tokens (identity over them): for random-weight models")
    ap.add_argument("--errant", action="store_true", help="ERRANT F0.5 against the references (correction)")
    ap.add_argument("--work", type=Path, default=None, help="conversions and exports (default: a temporary folder)")
    ap.add_argument("--out", type=Path, default=None)


def sha(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.is_file()):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


class Model:
    """One model as the systems need it: aggdec's framing of the sources and their length limits, text
    from token ids, and each peer's form of the model and its input, made once under `work`; `name`: the
    model's name in the results (a shape's, or the directory's)."""

    def __init__(self, path: Path, sources: list[str], work: Path, max_new: int | None, name: str):
        from aggdec.api import Translator, decode_options
        from aggdec.decoding.limits import max_len_for

        self.path, self.work, self.name = path, work, name
        self.tr = Translator.load(self.path)
        self.hf = "model_type" in json.loads((self.path / "config.json").read_text())
        ids = [self.tr.prepare(s)[0] for s in sources]
        if any(i is None for i in ids):
            raise ValueError(f"{path}: some sources are empty once cleaned; give sentences with text")
        self.src_ids = ids
        opts = decode_options()
        self.max_len_a, self.max_len_b = (0, max_new) if max_new else (opts.max_len_a, opts.max_len_b)
        self.limits = [max_len_for(len(i), self.max_len_a, self.max_len_b, self.tr.cfg.max_target_positions)
                       for i in ids]
        self.key = f"{self.name}-{sha(self.path)}"
        if self.hf:
            from transformers import AutoTokenizer

            self.hf_tok = AutoTokenizer.from_pretrained(self.path)
            self.pieces = [self.hf_tok.convert_ids_to_tokens(self.hf_tok(s).input_ids) for s in sources]
        else:
            sp = self.tr.bundle.src_tok.sp  # aggdec's models: sentencepiece ids, the eos added by the peer
            self.pieces = [sp.id_to_piece(i[:-1]) for i in ids]
        self.target_prefix = self.pieces_of(list(self.tr.framing().forced))  # CTranslate2's: M2M100's language

    def pieces_of(self, ids: list[int]) -> list[str]:
        """Token ids of the model as a peer's pieces."""
        if self.hf:
            return self.hf_tok.convert_ids_to_tokens(ids)
        return [self.tr.bundle.tgt_tok.sp.id_to_piece(i) for i in ids]

    def ids(self, pieces: list[str]) -> list[int]:
        """A peer's output pieces as the model's token ids."""
        if self.hf:
            return self.hf_tok.convert_tokens_to_ids(pieces)
        return [self.tr.bundle.tgt_tok.sp.piece_to_id(p) for p in pieces]

    def text(self, ids: list[int]) -> str:
        return self.tr.bundle.tgt_tok.decode(ids)

    def fairseq_export(self) -> Path:
        from aggdec.fairseq_io import save_fairseq

        out = self.work / f"{self.key}-fairseq"
        if not (out / "checkpoint.pt").is_file():
            save_fairseq(self.path, out)
        return out

    def ct2_model(self) -> Path:
        """The model converted by CTranslate2's own converter (in a process of its own)."""
        out = self.work / f"{self.key}-ct2"
        if not (out / "model.bin").is_file():
            if self.hf:
                cmd = ["ct2-transformers-converter", "--model", str(self.path)]
            else:
                export = self.fairseq_export()
                cmd = ["ct2-fairseq-converter", "--model_path", str(export / "checkpoint.pt"), "--data_dir",
                       str(export), "--source_lang", "src", "--target_lang", "tgt",
                       "--unsafe_deserialization"]  # our own export: a trusted pickle
            env = dict(os.environ, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")
            subprocess.run([*cmd, "--output_dir", str(out), "--force"], check=True, capture_output=True, env=env)
        return out

    def fairseq_inputs(self, counts: list[int]) -> dict[str, str]:
        """The first n pieces of each count binarized with the export's dictionaries: {n: folder}."""
        export, out = self.fairseq_export(), {}
        for n in counts:
            raw, binary = self.work / f"{self.key}-raw-{n}", self.work / f"{self.key}-bin-{n}"
            if not (binary / "test.src-tgt.src.bin").is_file():
                raw.mkdir(parents=True, exist_ok=True)
                lines = "".join(" ".join(p) + "\n" for p in self.pieces[:n])
                for lang in ("src", "tgt"):
                    (raw / f"test.{lang}").write_text(lines, encoding="utf-8")
                subprocess.run([sys.executable, "-m", "fairseq_cli.preprocess", "--source-lang", "src",
                                "--target-lang", "tgt", "--testpref", str(raw / "test"), "--destdir", str(binary),
                                "--srcdict", str(export / "dict.src.txt"), "--tgtdict", str(export / "dict.tgt.txt"),
                                "--workers", "1"], check=True, capture_output=True)
            out[str(n)] = str(binary)
        return out


def aggdec_options(a: argparse.Namespace, system: System) -> dict[str, Any]:
    """The decode options of aggdec's `system` under the run's arguments (drafters, beam, `--set`)."""
    options: dict[str, Any] = {"method": system.method, "precision": system.precision}
    if system.method != "beam":  # a system compiles where it says so (`+compile`; `+auto`: as `compile = "auto"` picks)
        options["compile"] = system.compile
    if system.method in ("gad", "gad++"):
        options["drafter"] = str(Path(a.drafter).resolve())
    elif system.method == "blockwise":
        options["drafter"] = str(Path(a.heads).resolve())
    elif system.method == "beam":
        options["beam"] = a.beam
    for item in a.set:
        key, _, value = item.partition("=")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


class Matrix:
    """The systems of a run, their models and their processes."""

    def __init__(self, a: argparse.Namespace):
        from aggdec.train.ar import read_tsv

        self.a = a
        named = [System.parse(s) for s in a.systems.split(",") if s]
        self.systems = [layout for s in named for layout in s.expand(a.threads)]
        names = [s.name for s in self.systems]
        if len(set(names)) != len(names):
            raise ValueError("--systems: a system is named twice")
        also = [n for n in a.also_identical.split(",") if n]
        for option, name in [("--reference", a.reference)] + [("--also-identical", n) for n in also]:
            if name not in names:
                raise ValueError(f"{option} {name}: not one of --systems")
        self.also = [s for s in self.systems if s.name in also]
        self.sizes = [int(b) for b in a.batch_sizes.split(",")]
        sources, refs = read_tsv(a.data, a.column, a.ref_column or a.column)
        keep = [i for i, s in enumerate(sources) if s.strip()][: a.limit]
        self.sources, self.refs = [a.prefix + sources[i] for i in keep], [refs[i] for i in keep]
        self.work = a.work or Path(os.environ.get("TMPDIR", "/tmp")) / f"aggdec-bench-{os.getpid()}"
        self.work.mkdir(parents=True, exist_ok=True)
        self.models: dict[str, Model] = {}
        self.processes: dict[str, Process] = {}
        self.errors: dict[tuple[str, int], str] = {}

    def count(self, bs: int) -> int:
        return min(self.a.bs1_limit, len(self.sources)) if bs == 1 else len(self.sources)

    def model(self, system: System) -> Model:
        path = system.model or self.a.model
        if path not in self.models:
            built = resolve(path, self.a.data, self.a.column, self.work)
            self.models[path] = Model(built, self.sources, self.work, self.a.max_new, Path(path).name)
        return self.models[path]

    def job(self, system: System) -> dict[str, Any]:
        """What a system's process needs (bench/systems.py's runners)."""
        a, m = self.a, self.model(system)
        beam = a.beam if system.method == "beam" else 1
        job = {"kind": system.kind, "threads": system.threads or a.threads, "workers": system.workers,
               "device": a.device, "work": str(self.work), "model": str(m.path), "beam": beam}
        if system.kind == "aggdec":
            for item in a.set:
                if item.partition("=")[0] in ("max_len_a", "max_len_b"):
                    raise ValueError(f"--set {item.partition('=')[0]}: the peers would not follow it; give --max-new")
            options = aggdec_options(a, system) | {"max_len_a": m.max_len_a, "max_len_b": m.max_len_b}
            return {**job, "options": options, "inputs": self.sources, "cold": a.cold}
        if system.kind == "ct2":
            return {**job, "ct2_model": str(m.ct2_model()), "compute": system.precision, "inputs": m.pieces,
                    "target_prefix": m.target_prefix, "max_len": max(m.limits)}
        if system.kind == "transformers":
            if not m.hf:
                raise ValueError(f"{system.name}: transformers runs Hugging Face model directories, not {m.path}")
            return {**job, "inputs": self.sources, "limits": m.limits, "precision": system.precision}
        return {**job, "checkpoint": str(m.fairseq_export() / "checkpoint.pt"), "max_len_a": m.max_len_a,
                "max_len_b": m.max_len_b, "bin": m.fairseq_inputs(sorted({self.count(bs) for bs in self.sizes}))}

    def start(self) -> None:
        """Each system's process; a system whose model a peer cannot take (a conversion that fails)
        gets its error at every batch size instead."""
        for i, system in enumerate(self.systems):
            try:
                job = self.job(system)
            except subprocess.CalledProcessError as e:
                why = (e.stderr or b"").decode(errors="replace").strip().splitlines()[-1:] or [str(e)]
                self.errors.update({(system.name, bs): f"preparing {system.name}: {why[0]}"[:500] for bs in self.sizes})
                continue
            (self.work / f"job-{i}.json").write_text(json.dumps(job))
            self.processes[system.name] = Process(system, self.work / f"job-{i}.json", system.threads or self.a.threads,
                                                  REPO)

    def stop(self) -> None:
        """Close the systems' processes."""
        for p in self.processes.values():
            p.close()
        self.processes.clear()

    def close(self) -> None:
        self.stop()
        if self.a.work is None:
            shutil.rmtree(self.work, ignore_errors=True)

    def rounds(self, conditions: dict[str, Callable[[], Any] | None]
               ) -> Iterator[tuple[System, int, str, dict, bool]]:
        """For each of `--processes` rounds, start the systems' processes and go round them: every repeat,
        batch size, system (each round from the next system on) and condition (a name, and a context manager
        factory to decode under, or None) in turn; -> (system, batch size, condition, reply, whether it is the
        process's first reply at that batch size and condition) of each reply without an error. A system that
        answers with an error at a batch size is not asked there again (`errors`). A round's processes are
        closed at its end."""
        try:
            for proc in range(self.a.processes):
                self.start()
                turn = proc % len(self.systems)  # each round from another system on (the last asked reads slowest)
                for rep in range(self.a.repeat):
                    for bs in self.sizes:
                        n = self.count(bs)
                        for system in self.systems[turn:] + self.systems[:turn]:
                            for name, condition in conditions.items():
                                if (system.name, bs) in self.errors:
                                    continue
                                with condition() if condition else nullcontext():
                                    reply = self.processes[system.name].request(bs, n)
                                label = f"process {proc} rep {rep} bs {bs} {system.name}{' ' + name if name else ''}"
                                if "error" in reply:
                                    self.errors[(system.name, bs)] = reply["error"]
                                    print(f"{label}: {reply['error']}", file=sys.stderr, flush=True)
                                    continue
                                print(f"{label}: {n / reply['seconds']:.1f} sentences/s", flush=True)
                                yield system, bs, name, reply, rep == 0
                                time.sleep(0.5)  # let the last process's threads go idle before the next one starts
                self.stop()
        finally:
            self.close()

    def reference(self, system: System) -> System | None:
        """The system whose outputs `system`'s are compared with: a peer's beam search with aggdec's
        `beam` where it runs (aggdec's `beam` itself with none), any other with `--reference`."""
        if system.method == "beam":
            beam = next((s for s in self.systems if s.kind == "aggdec" and s.method == "beam"
                         and s.model == system.model and s.precision == "fp32"), None)
            return None if beam is system else beam
        return next(s for s in self.systems if s.name == self.a.reference)

    def ids(self, system: System, outputs: list) -> list[list[int]]:
        """A reply's outputs as token ids (CTranslate2 and fairseq answer in pieces)."""
        if system.kind in ("ct2", "fairseq"):
            return [self.model(system).ids(o) for o in outputs]
        return outputs


def recorded(a: argparse.Namespace) -> dict[str, Any]:
    """The options a results file records: paths as `record.shown` writes them."""
    def one(v: Any) -> Any:
        return shown(str(v)) if isinstance(v, Path) else [one(x) for x in v] if isinstance(v, list) else v

    return {k: one(v) for k, v in vars(a).items() if k not in ("out", "work", "func", "command")}


def median_rate(seconds: list[float], n: int) -> float:
    return n / statistics.median(seconds)


def measure(a: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """The runs of `compare`: every system at every batch size, repeats interleaved (module docstring)."""
    matrix = Matrix(a)
    seconds: dict[tuple[str, int], list[float]] = {}
    outputs: dict[tuple[str, int], list[list[int]]] = {}
    extra: dict[tuple[str, int], dict] = {}
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    first: dict[tuple[str, int], list[float]] = {}  # each process's first call (`--cold`)
    for system, bs, _, reply, fresh in matrix.rounds({"": None}):
        key = (system.name, bs)
        seconds.setdefault(key, []).append(reply["seconds"])
        if fresh and a.cold and system.kind == "aggdec":
            first.setdefault(key, []).append(reply["seconds"])
        outputs[key] = matrix.ids(system, reply["outputs"])
        extra[key] = {k: v for k, v in reply.items() if k not in ("seconds", "outputs", "modules")}
    scores: dict[tuple, dict] = {}
    for system in matrix.systems:
        model = matrix.model(system)
        reference = matrix.reference(system)
        for bs in matrix.sizes:
            key, n = (system.name, bs), matrix.count(bs)
            run: dict[str, Any] = {"model": model.name, "system": system.name, "method": system.name,
                                   "batch_size": bs, "sentences": n, "layout": system.layout(a.threads)}
            runs[key] = run
            if key in matrix.errors:
                run["error"] = matrix.errors[key]
                yield run
                continue
            outs = outputs[key]
            toks = sum(len(o) + 1 for o in outs)
            run.update(sentences_per_s=round(median_rate(seconds[key], n), 2),
                       all_sentences_per_s=[round(n / s, 2) for s in seconds[key]],
                       tokens_per_s=round(toks / statistics.median(seconds[key]), 1), **extra[key])
            if key in first:
                run["first_sentences_per_s"] = [round(n / s, 2) for s in first[key]]
            ref = outputs.get((reference.name, bs)) if reference and matrix.model(reference) is model else None
            if ref is not None:
                run["identical"] = identical_share(outs, ref, model.limits)
            for other in matrix.also:
                theirs = outputs.get((other.name, bs))
                if other is not system and theirs is not None and matrix.model(other) is model:
                    run[f"identical_to_{other.name}"] = identical_share(outs, theirs, model.limits)
            if a.ref_column:
                hyps = tuple(model.text(o) for o in outs)
                if hyps not in scores:
                    scores[hyps] = score(matrix.sources[:n], list(hyps), matrix.refs[:n], a.errant and bs != 1)
                run.update(scores[hyps])
            yield run
    searches: dict[str, list[System]] = {}
    for system in matrix.systems:
        if system.searched:
            searches.setdefault(system.searched, []).append(system)
    for name, members in searches.items():
        for bs in matrix.sizes:
            yield best_of(name, [runs[(s.name, bs)] for s in members])


def best_of(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of search `name` at one batch size, from its layouts' runs there: the fastest one's
    fields under `name`, with `best` (its system) and `layouts` (each layout's sentences/s, None
    where it failed); an error where every layout failed."""
    head = {"model": runs[0]["model"], "system": name, "method": name, "batch_size": runs[0]["batch_size"],
            "sentences": runs[0]["sentences"]}
    layouts = {r["layout"]: r.get("sentences_per_s") for r in runs}
    done = [r for r in runs if "error" not in r]
    if not done:
        return {**head, "layouts": layouts, "error": f"every layout failed; {runs[0]['layout']}: {runs[0]['error']}"}
    top = max(done, key=lambda r: r["sentences_per_s"])
    return {**top, **head, "best": top["system"], "layouts": layouts}


def identical_share(outs: list[list[int]], ref: list[list[int]], limits: list[int]) -> float:
    """The share of outputs equal to the reference's over their first `limits[i]` tokens (module
    docstring): the same length rule on both sides, whichever decoding step limit each peer took."""
    return round(sum(x[:cut] == y[:cut] for x, y, cut in zip(outs, ref, limits)) / len(outs), 4)


def compare(a: argparse.Namespace) -> int:
    results = Results(a.out, "compare", recorded(a), a.device)
    for run in measure(a):
        results.add(run)
    return 1 if results.failed else 0


def score(sources: list[str], hyps: list[str], refs: list[str], errant: bool) -> dict[str, Any]:
    from aggdec.evaluate import bleu_chrf, gec_scores

    b = bleu_chrf(hyps, refs)
    out = {"bleu": round(b["bleu"], 2), "chrf": round(b["chrf"], 2), "bleu_signature": b["bleu_signature"]}
    if errant:
        out["f0.5"] = round(gec_scores(sources, hyps, refs)["f0.5"], 4)
    return out


@contextmanager
def competitors(count: int, threads: int) -> Iterator[None]:
    """`count` processes, each multiplying matrices on `threads` threads, running until the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", COMPETITOR, str(threads)], stdout=subprocess.PIPE, text=True,
                              env=dict(START_ENV, OMP_NUM_THREADS=str(threads))) for _ in range(count)]
    try:
        for p in procs:
            p.stdout.readline()  # "ready": it computes
        yield
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()


def contention(a: argparse.Namespace) -> int:
    """Each system quiet, then beside `--competitors` compute processes, in turn; the share it keeps."""
    matrix = Matrix(a)
    settings = recorded(a)
    results = Results(a.out, "contention", settings, a.device)
    seconds: dict[tuple[str, int, str], list[float]] = {}
    busy = {"quiet": None, "contended": lambda: competitors(a.competitors, a.competitor_threads)}
    for system, bs, condition, reply, _ in matrix.rounds(busy):
        seconds.setdefault((system.name, bs, condition), []).append(reply["seconds"])
    for system in matrix.systems:
        for bs in matrix.sizes:
            run = {"model": matrix.model(system).name, "system": system.name, "method": system.name,
                   "batch_size": bs, "sentences": matrix.count(bs)}
            if (system.name, bs) in matrix.errors:
                results.add({**run, "error": matrix.errors[(system.name, bs)]})
                continue
            quiet = median_rate(seconds[(system.name, bs, "quiet")], run["sentences"])
            contended = median_rate(seconds[(system.name, bs, "contended")], run["sentences"])
            results.add({**run, "sentences_per_s": round(contended, 2), "quiet_sentences_per_s": round(quiet, 2),
                         "contended_sentences_per_s": round(contended, 2), "kept": round(contended / quiet, 3)})
    return 1 if results.failed else 0
