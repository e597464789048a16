"""Shared fixtures. `tiny_model_dir`: a small project-format model directory (sentencepiece + weights).

The model is trained for a few seconds to copy its input, so its logits are decisive (outputs do not
flip between batch compositions) and IAD accepts drafts. It is built once per test session.
"""

from __future__ import annotations

import atexit
import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

# Tests never read or write the user's TorchInductor cache and compile store (compiled programs, `warm`
# markers, measured rates, which would change what `compile = "auto"` picks): each test process, and what
# it starts, has a cache directory of its own (tests of the store set their own).
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="aggdec-test-inductor-")
os.environ["AGGDEC_CACHE_DIR"] = tempfile.mkdtemp(prefix="aggdec-test-store-")
for _path in (os.environ["TORCHINDUCTOR_CACHE_DIR"], os.environ["AGGDEC_CACHE_DIR"]):
    atexit.register(shutil.rmtree, _path, ignore_errors=True)
# Without a CUDA device, Triton's kernels (aggdec.model.invariant) run on CPU tensors through its interpreter,
# which Triton decides as it is imported (before anything imports it: TorchInductor does)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from aggdec.decoding.compiled_step import lowered_isa  # noqa: E402  (after the cache directory is set)

compiles = pytest.mark.skipif(lowered_isa() is not None, reason=f"{lowered_isa()}: the slot loop does not compile")
"""Marks a test of compiled decoder steps: skipped where ATEN_CPU_CAPABILITY lowers ATen's ISA below
this CPU's own (`lowered_isa`), where the loop decodes eagerly instead."""

WORDS = ("the cat dog house school go goes went she he they we is are was were a an to of in on at with for and "
         "but run runs ran big small red green quick slow happy sad today yesterday teacher student book books "
         "read reads write wrote people city country morning evening because although very much many little "
         "should could would have has had been being good better best bad worse worst friend friends").split()


def synthetic_sentences(n: int, seed: int = 0) -> list[str]:
    """`n` deterministic pseudo-English sentences of 3-12 words."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))).capitalize() + " ." for _ in range(n)]


def build_tiny_model(out_dir: Path, *, vocab: int = 100, steps: int = 150, seed: int = 0) -> Path:
    """Train a unigram sentencepiece model and a 2+2-layer d=32 Transformer on a copy task; save it."""
    import sentencepiece as spm

    from aggdec import bundle
    from aggdec.model.config import ModelConfig
    from aggdec.model.transformer import Transformer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = synthetic_sentences(400, seed)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_prefix=str(out_dir / "spm_train"), vocab_size=vocab,
        model_type="unigram", character_coverage=1.0, byte_fallback=False, bos_id=0, pad_id=1, eos_id=2, unk_id=3,
        shuffle_input_sentence=False, hard_vocab_limit=False, num_threads=1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(out_dir / "spm_train.model"))
    n = sp.get_piece_size()
    torch.manual_seed(seed)
    cfg = ModelConfig(src_vocab=n, tgt_vocab=n, d_model=32, enc_layers=2, dec_layers=2, enc_heads=2, dec_heads=2,
                      enc_ffn=64, dec_ffn=64, share_all_embeddings=True, dropout=0.0,
                      max_source_positions=128, max_target_positions=128)
    model = Transformer(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    ids = [sp.encode(t) + [cfg.eos] for t in texts]
    rng = random.Random(seed)
    model.train()
    for _ in range(steps):  # copy task: target = source
        batch = rng.sample(ids, 32)
        width = max(map(len, batch))
        src = torch.full((32, width), cfg.pad)
        prev = torch.full((32, width), cfg.pad)
        tgt = torch.full((32, width), cfg.pad)
        for b, s in enumerate(batch):
            src[b, :len(s)] = torch.tensor(s)
            prev[b, :len(s)] = torch.tensor([cfg.eos] + s[:-1])
            tgt[b, :len(s)] = torch.tensor(s)
        logits = model(src, prev)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, n), tgt.reshape(-1), ignore_index=cfg.pad)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    tokenizer = {"type": "sentencepiece", "src": "spm.model", "tgt": "spm.model"}
    return bundle.save(out_dir, model, tokenizer, {"spm.model": out_dir / "spm_train.model"},
                           dtype=torch.float32, meta={"note": "test fixture: tiny copy model"})


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny trained model directory (config.json, model.safetensors, spm.model), built once per session."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is fastest, and the CPU is shared
    try:
        return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def double_token_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """`tiny_model_dir` turned into a double-token model (aggdec.double_token) by the trainer's
    `--init-from ... --double-token`, trained a few seconds on the same copy task."""
    from aggdec.train import ar

    work = tmp_path_factory.mktemp("double-token")
    for name, n, seed in (("train.tsv", 400, 0), ("valid.tsv", 40, 9)):
        with open(work / name, "w", encoding="utf-8") as f:
            f.write("src\ttgt\n" + "".join(f"{s}\t{s}\n" for s in synthetic_sentences(n, seed)))
    threads = torch.get_num_threads()
    try:
        ar.main(["--train", str(work / "train.tsv"), "--valid", str(work / "valid.tsv"), "--src-col", "src",
                 "--tgt-col", "tgt", "--init-from", str(tiny_model_dir), "--double-token", "--out", str(work / "model"),
                 "--max-updates", "400", "--max-tokens", "1024", "--lr", "3e-3", "--warmup", "100", "--rewarmup", "20",
                 "--dropout", "0", "--eval-updates", "400", "--log-interval", "100", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    return work / "model"
