"""Token-for-token parity with fairseq 0.12 (fairseq-fixed): our greedy and beam search vs
`fairseq-generate`, on tiny transformers trained here by `fairseq-train` on a synthetic corpus.

Two configurations, each trained once (module-scoped fixture):
  (a) post-norm, sinusoidal positions, --share-all-embeddings (joined dictionary);
  (b) pre-norm, learned positions, separate dictionaries, --layernorm-embedding.
Skipped when fairseq is not installed (CI installs it).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.fairseq
pytest.importorskip("fairseq")

from tiny_models import FAIRSEQ_CONFIGS as TINY_CONFIGS  # noqa: E402
from tiny_models import tiny_model

from aggdec import checkpoint  # noqa: E402
from aggdec.decoding.beam import beam_search  # noqa: E402
from aggdec.decoding.limits import max_len_for  # noqa: E402
from aggdec.decoding.metadata import Request  # noqa: E402
from aggdec.decoding.slot_loop import SlotLoop  # noqa: E402
from aggdec.fairseq_io import convert_fairseq, load_fairseq, save_fairseq  # noqa: E402

# One thread per fairseq process: the models are tiny and the test machine may be shared (with two
# threads and a busy CPU, training was ~6x slower).
ENV = dict(os.environ, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
           PYTHONWARNINGS="ignore")

COMMON_TRAIN = ("--cpu --arch transformer --encoder-embed-dim 32 --encoder-ffn-embed-dim 64 --encoder-layers 2 "
                "--encoder-attention-heads 4 --decoder-embed-dim 32 --decoder-ffn-embed-dim 64 --decoder-layers 2 "
                "--decoder-attention-heads 4 --optimizer adam --lr 0.005 --lr-scheduler inverse_sqrt "
                "--warmup-updates 50 --dropout 0.1 --criterion label_smoothed_cross_entropy --label-smoothing 0.1 "
                "--max-tokens 256 --max-update 300 --no-epoch-checkpoints --save-interval 1000 "
                "--disable-validation --seed 1 --log-format simple --log-interval 100 --num-workers 0").split()

CONFIGS = {
    "postnorm-sinusoidal-shared": (["--joined-dictionary"], ["--share-all-embeddings"]),
    "prenorm-learned-separate-lnemb": ([], ["--encoder-normalize-before", "--decoder-normalize-before",
                                            "--encoder-learned-pos", "--decoder-learned-pos", "--layernorm-embedding",
                                            "--max-source-positions", "64", "--max-target-positions", "64"]),
}

# name -> (beam, max_len_a, max_len_b, lenpen). "tight" forces eos at max_len for most sentences.
SETTINGS = {
    "greedy": (1, 1.2, 2, 1.0),
    "beam5": (5, 1.2, 2, 1.0),
    "beam4-tight-lenpen": (4, 0.0, 3, 0.6),
}

_generated: dict[tuple[str, str], dict[int, str]] = {}


def _cli(module: str, *args, cwd: Path) -> str:
    cmd = [sys.executable, "-m", f"fairseq_cli.{module}", *map(str, args)]
    p = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=400)
    if p.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-4000:]}")
    return p.stdout


def _write_corpus(d: Path) -> None:
    """~300 training pairs over 30 source words; target = word-by-word substitution (t_{7i mod 30})."""
    rng = random.Random(0)
    src_words = [f"s{i}" for i in range(30)]
    tgt_words = [f"t{(7 * i) % 30}" for i in range(30)]
    for split, n in (("train", 300), ("valid", 20), ("test", 40)):
        pairs = []
        for _ in range(n):
            ids = [rng.randrange(30) for _ in range(rng.randint(2, 9))]
            pairs.append((" ".join(src_words[i] for i in ids), " ".join(tgt_words[i] for i in ids)))
        (d / f"{split}.src").write_text("".join(p[0] + "\n" for p in pairs), encoding="utf-8")
        (d / f"{split}.tgt").write_text("".join(p[1] + "\n" for p in pairs), encoding="utf-8")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fairseq-corpus")
    _write_corpus(d)
    return d


@pytest.fixture(scope="module", params=list(CONFIGS))
def trained(request, corpus, tmp_path_factory):
    """(name, data-bin dir, checkpoint) of a tiny fairseq transformer trained for 300 updates."""
    name = request.param
    pre_args, train_args = CONFIGS[name]
    work = tmp_path_factory.mktemp(f"fairseq-{name}")
    t0 = time.perf_counter()
    _cli("preprocess", "--source-lang", "src", "--target-lang", "tgt", "--trainpref", corpus / "train",
         "--validpref", corpus / "valid", "--testpref", corpus / "test", "--destdir", work / "bin",
         "--workers", "1", *pre_args, cwd=work)
    _cli("train", work / "bin", *COMMON_TRAIN, *train_args, "--save-dir", work / "ckpt", cwd=work)
    ckpt = work / "ckpt" / "checkpoint_last.pt"
    assert ckpt.is_file()
    print(f"[{name}] preprocess + train: {time.perf_counter() - t0:.1f}s")
    return name, work / "bin", ckpt


def _parse_h(stdout: str) -> dict[int, str]:
    out = {}
    for line in stdout.splitlines():
        if line.startswith("H-"):
            ident, _score, text = line.split("\t", 2)
            out[int(ident[2:])] = text
    return out


def _generate(data: Path, ckpt: Path, beam: int, a: float, b: int, lenpen: float, cwd: Path) -> dict[int, str]:
    stdout = _cli("generate", data, "--path", ckpt, "--gen-subset", "test", "--source-lang", "src",
                  "--target-lang", "tgt", "--beam", beam, "--lenpen", lenpen, "--max-len-a", a, "--max-len-b", b,
                  "--batch-size", 1, "--required-batch-size-multiple", 1, "--cpu", cwd=cwd)
    return _parse_h(stdout)


def _fairseq_outputs(trained, setting: str) -> dict[int, str]:
    name, data, ckpt = trained
    key = (name, setting)
    if key not in _generated:
        beam, a, b, lenpen = SETTINGS[setting]
        _generated[key] = _generate(data, ckpt, beam, a, b, lenpen, data.parent)
    return _generated[key]


def _requests(bundle, corpus: Path, a: float, b: int) -> list[Request]:
    cfg = bundle.model.cfg
    reqs = []
    for i, line in enumerate((corpus / "test.src").read_text(encoding="utf-8").splitlines()):
        ids = bundle.src_tok.encode(line) + [cfg.eos]
        reqs.append(Request(i, ids, max_len_for(len(ids), a, b, cfg.max_target_positions)))
    return reqs


def _text(bundle, tokens: list[int]) -> str:
    return " ".join(bundle.tgt_tok.dict.symbols[t] for t in tokens)


def _ours(bundle, corpus: Path, setting: str) -> dict[str, dict[int, str]]:
    beam, a, b, lenpen = SETTINGS[setting]
    reqs = _requests(bundle, corpus, a, b)
    runs = {"beam_search": beam_search(bundle.model, reqs, beam=beam, lenpen=lenpen, max_batch_size=1)}
    if beam == 1:
        runs["greedy loop"] = list(SlotLoop(bundle.model, max_batch_size=1).run(reqs))
    return {k: {h.index: _text(bundle, h.tokens) for h in hyps} for k, hyps in runs.items()}


@pytest.mark.parametrize("setting", [pytest.param(k, marks=pytest.mark.slow) if "tight" in k else k for k in SETTINGS])
def test_matches_fairseq_generate(trained, corpus, setting):
    name, data, ckpt = trained
    bundle = load_fairseq(ckpt, data, trust=True)
    ref = _fairseq_outputs(trained, setting)
    assert len(ref) == 40, "fairseq-generate must print one hypothesis per test sentence"
    for method, got in _ours(bundle, corpus, setting).items():
        diff = [(i, got[i], ref[i]) for i in sorted(ref) if got[i] != ref[i]]
        assert not diff, f"{name}/{setting}/{method}: {len(diff)} of {len(ref)} differ, e.g. {diff[:3]}"


def test_beam_is_not_greedy_here(trained):
    """Sanity: on these models beam 5 picks other outputs than greedy for some sentences."""
    greedy, beam5 = _fairseq_outputs(trained, "greedy"), _fairseq_outputs(trained, "beam5")
    assert any(greedy[i] != beam5[i] for i in greedy)


def test_export_back_to_fairseq(trained, corpus, tmp_path):
    """fairseq ckpt -> load_fairseq -> save_fairseq -> fairseq-generate gives the same outputs; the
    project-format conversion decodes identically; CTranslate2's loading path accepts the export."""
    import fairseq

    name, data, ckpt = trained
    bundle = load_fairseq(ckpt, data, trust=True)
    exp = save_fairseq(bundle, tmp_path / "export")
    for f in data.glob("test.src-tgt.*"):
        shutil.copyfile(f, exp / f.name)
    for side in ("src", "tgt"):  # the exported dictionaries list the same symbols
        ours = [ln.rsplit(" ", 1)[0] for ln in (exp / f"dict.{side}.txt").read_text(encoding="utf-8").splitlines()]
        theirs = [ln.rsplit(" ", 1)[0] for ln in (data / f"dict.{side}.txt").read_text(encoding="utf-8").splitlines()]
        assert ours == theirs
    beam, a, b, lenpen = SETTINGS["beam5"]
    assert _generate(exp, exp / "checkpoint.pt", beam, a, b, lenpen, tmp_path) == _fairseq_outputs(trained, "beam5")

    # CTranslate2's FairseqConverter: args = cfg["model"]; setup_task(args); build_model; load_state_dict.
    state = torch.load(exp / "checkpoint.pt", map_location="cpu", weights_only=False)
    args = state["args"] or state["cfg"]["model"]
    args.data = str(exp)
    task = fairseq.tasks.setup_task(args)
    model = fairseq.models.build_model(args, task)
    model.load_state_dict(state["model"])
    assert len(task.source_dictionary) == bundle.model.cfg.src_vocab
    assert (model.decoder.layer_norm is not None) == bundle.model.cfg.dec_normalize_before

    proj = checkpoint.load(convert_fairseq(ckpt, data, tmp_path / "proj", trust=True))
    reqs = _requests(proj, corpus, a, b)
    got = {h.index: _text(proj, h.tokens) for h in beam_search(proj.model, reqs, beam=beam, max_batch_size=1)}
    assert got == _fairseq_outputs(trained, "beam5")


def test_untrusted_and_mismatched_dictionary(trained, tmp_path):
    name, data, ckpt = trained
    with pytest.raises(PermissionError, match="pickle"):
        load_fairseq(ckpt, data, trust=False)
    bad = tmp_path / "bad-data"
    bad.mkdir()
    shutil.copyfile(data / "dict.src.txt", bad / "dict.src.txt")
    lines = (data / "dict.tgt.txt").read_text(encoding="utf-8").splitlines()
    (bad / "dict.tgt.txt").write_text("\n".join(lines[:-3]) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=str(bad / "dict.tgt.txt")):
        load_fairseq(ckpt, bad, trust=True)


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
def test_sequence_generator_on_random_models(kind, tmp_path, monkeypatch):
    """In-process: fairseq's SequenceGenerator vs our beam search on random float32 models, tiny
    vocabularies included (beam capped at V-1), several beam sizes, per-sentence max_len."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # fairseq's torch.load predates weights_only
    from fairseq import checkpoint_utils
    from fairseq.sequence_generator import SequenceGenerator
    from test_beam import _bundle
    from test_beam import _requests as random_requests

    for vocab in (6, 13):
        model = tiny_model(kind, seed=1, vocab=vocab, **({"tgt_vocab": vocab + 4} if "separate" in kind else {})).float()
        exp = save_fairseq(_bundle(model), tmp_path / f"v{vocab}")
        models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task([str(exp / "checkpoint.pt")])
        fmodel = models[0].eval()
        reqs = random_requests(model, n=10, seed=vocab, max_out=12)
        for beam in (1, 3, 5):
            ours = beam_search(model, reqs, beam=beam, max_batch_size=4)
            for r, h in zip(reqs, ours):
                gen = SequenceGenerator([fmodel], task.target_dictionary, beam_size=beam, max_len_a=0,
                                        max_len_b=r.max_len)
                sample = {"net_input": {"src_tokens": torch.tensor([r.src]), "src_lengths": torch.tensor([len(r.src)])}}
                theirs = [t for t in gen.generate([fmodel], sample)[0][0]["tokens"].tolist() if t != model.cfg.eos]
                assert h.tokens == theirs, (vocab, beam, r)
