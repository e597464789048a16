"""Beam search (fairseq SequenceGenerator semantics) and the fairseq checkpoint round trip.

No fairseq import here: parity with fairseq itself is in test_fairseq_parity.py.
"""

from __future__ import annotations

import argparse
import math
import random

import pytest
import torch
from tiny_models import CONFIGS, FAIRSEQ_CONFIGS, naive_greedy, tiny_model

from aggdec.bundle import Bundle
from aggdec.decoding import beam as beam_module
from aggdec.decoding import scheduler as loop_module
from aggdec.decoding.beam import beam_search
from aggdec.decoding.candidates import chunk_for, top_candidates
from aggdec.decoding.limits import max_len_for
from aggdec.decoding.metadata import Request
from aggdec.decoding.slot_loop import SlotLoop
from aggdec.fairseq_io import convert_fairseq, load_fairseq, save_fairseq
from aggdec.model.config import ModelConfig
from aggdec.model.transformer import Transformer
from aggdec.tokenizers import DictionaryTokenizer
from aggdec.tokenizers.dictionary import SPECIALS, Dictionary


def _requests(model, n=24, seed=0, max_src=9, max_out=18):
    rng = random.Random(seed)
    cfg = model.cfg
    return [Request(index=i, src=[rng.randrange(4, cfg.src_vocab) for _ in range(rng.randint(0, max_src))] + [cfg.eos],
                    max_len=rng.randint(1, max_out)) for i in range(n)]


def _greedy(model, reqs, bs=7):
    return {h.index: h.tokens for h in SlotLoop(model, max_batch_size=bs).run(reqs)}


def test_max_len_for():
    assert max_len_for(6, 1.2, 3, 1024) == 10  # int(10.2)
    assert max_len_for(6, 0, 200, 1024) == 200
    assert max_len_for(6, 0, 200, 64) == 63  # capped at max_target_positions - 1
    assert max_len_for(7, 1.5, 10, 1024) == 20


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_beam1_equals_greedy(kind):
    for seed in (0, 1):
        model = tiny_model(kind, seed=seed)
        reqs = _requests(model, seed=seed)
        greedy = _greedy(model, reqs)
        hyps = beam_search(model, reqs, beam=1, max_batch_size=5)
        assert [h.index for h in hyps] == [r.index for r in reqs], "results come back in input order"
        for h, r in zip(hyps, reqs):
            assert h.tokens == greedy[r.index]
            assert h.stats.iterations == len(h.tokens) + 1  # one decoder call per token incl. eos
            assert len(h.tokens) <= r.max_len
    reqs = _requests(model, n=4, seed=3)
    for h, r in zip(beam_search(model, reqs, beam=1), reqs):
        assert h.tokens == naive_greedy(model, r.src, r.max_len)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_beam_batch_composition_does_not_matter(kind):
    model = tiny_model(kind, seed=2)
    reqs = _requests(model, n=20, seed=5)
    for beam in (2, 5):
        ref = [h.tokens for h in beam_search(model, reqs, beam=beam, max_batch_size=1)]
        for bs in (3, 16):
            got = beam_search(model, reqs, beam=beam, max_batch_size=bs)
            assert [h.tokens for h in got] == ref
        shuffled = reqs[::-1]
        got = beam_search(model, shuffled, beam=beam, max_batch_size=6)
        assert [h.index for h in got] == [r.index for r in shuffled]
        assert [h.tokens for h in got] == ref[::-1]
        for h, r in zip(beam_search(model, reqs, beam=beam, max_batch_size=8), reqs):
            assert len(h.tokens) <= r.max_len
            assert len(h.tokens) + 1 <= h.stats.iterations <= r.max_len + 1
            assert model.cfg.pad not in h.tokens and model.cfg.eos not in h.tokens


def test_beam_batches_are_encoded_ahead(monkeypatch):
    """Static beam batches are encoded several at a time (whole batches, at most ENCODE_AHEAD
    sentences within ENCODE_AHEAD_TOKENS); outputs are those of encoding each batch alone."""
    model = tiny_model("marian-like", seed=3)
    reqs = _requests(model, n=45, seed=11, max_src=30)
    rows: list[tuple[int, int]] = []
    encode = type(model).encode
    monkeypatch.setattr(type(model), "encode", lambda self, src: rows.append(tuple(src.shape)) or encode(self, src))
    monkeypatch.setattr(loop_module, "ENCODE_AHEAD_TOKENS", 200)
    monkeypatch.setattr(loop_module, "ENCODE_AHEAD", 1)
    alone = [h.tokens for h in beam_search(model, reqs, beam=3, max_batch_size=2)]
    assert len(rows) == 23
    rows.clear()
    monkeypatch.setattr(loop_module, "ENCODE_AHEAD", 32)
    assert [h.tokens for h in beam_search(model, reqs, beam=3, max_batch_size=2)] == alone
    assert sum(b for b, _ in rows) == len(reqs) and len(rows) < 23 / 2, rows
    assert all(b % 2 == 0 or b == rows[-1][0] for b, _ in rows)  # whole batches, the last one aside
    assert all(b == 2 or b * width <= 200 for b, width in rows), rows


def test_top_candidates_equal_topk():
    """The chunked top-k returns torch.topk's values and columns (distinct values), also with -inf
    rows or chunks (forced tokens) and where too few chunks leave it to torch.topk."""
    gen = torch.Generator().manual_seed(0)
    assert chunk_for(8000) == 160 and chunk_for(2048) == 256 and chunk_for(13) is None
    for rows, width, count, chunk in ((7, 40000, 10, 160), (5, 8000, 10, 160), (16, 10240, 6, 256), (4, 640, 10, 64)):
        for dtype in (torch.float32, torch.float64):
            x = torch.randn(rows, width, generator=gen, dtype=dtype)
            x[0, : width // 2] = -math.inf  # half a row masked
            x[1] = -math.inf
            x[1, 5] = 0.0  # one finite value (a forced token): the rest of its candidates are -inf
            want, got = torch.topk(x, count), top_candidates(x, count, chunk)
            assert torch.equal(want.values, got[0])
            finite = want.values.isfinite()
            assert torch.equal(want.indices[finite], got[1][finite])
            assert torch.equal(x.gather(1, got[1]), got[0])  # the -inf ones are -inf columns too


def test_beam_with_chunked_top_k_equals_plain_top_k(monkeypatch):
    """A vocabulary large enough for chunked candidates: outputs and scores as with torch.topk."""
    model = tiny_model("postnorm-sinusoidal-shared", seed=5, vocab=2048)
    reqs = _requests(model, n=12, seed=3, max_out=10)
    chunked = beam_search(model, reqs, beam=5, nbest=3, max_batch_size=4)
    monkeypatch.setattr(beam_module, "chunk_for", lambda vocab: None)
    plain = beam_search(model, reqs, beam=5, nbest=3, max_batch_size=4)
    assert [h.nbest for h in chunked] == [h.nbest for h in plain]
    assert sum(len(h.tokens) > 0 for h in plain) > len(reqs) // 2


def test_beam_differs_from_greedy_sometimes_and_lenpen_matters():
    """Sanity: a wider beam finds other outputs than greedy on random models (the test is not vacuous)."""
    model = tiny_model("postnorm-sinusoidal-shared", seed=1)
    reqs = _requests(model, n=30, seed=7)
    greedy = _greedy(model, reqs)
    b5 = beam_search(model, reqs, beam=5)
    assert sum(h.tokens != greedy[h.index] for h in b5) > 0
    short = beam_search(model, reqs, beam=5, lenpen=0.2)
    long = beam_search(model, reqs, beam=5, lenpen=3.0)
    assert sum(len(h.tokens) for h in short) <= sum(len(h.tokens) for h in long)


def test_beam_tiny_vocabulary_and_bad_requests():
    """Vocabulary smaller than 2*beam (fairseq caps beam at V-1 and pads candidates with eos)."""
    model = tiny_model("postnorm-sinusoidal-shared", seed=3, vocab=6)
    reqs = _requests(model, n=10, seed=1, max_out=8)
    for beam in (3, 5, 9):
        a = beam_search(model, reqs, beam=beam, max_batch_size=1)
        b = beam_search(model, reqs, beam=beam, max_batch_size=10)
        assert [h.tokens for h in a] == [h.tokens for h in b]
    with pytest.raises(ValueError, match="max_len"):
        beam_search(model, [Request(0, [5, 2], 0)])
    with pytest.raises(ValueError, match="beam"):
        beam_search(model, reqs, beam=0)
    assert beam_search(model, []) == []


def _naive_score(model, src, toks):
    """Sum of log-probs of toks + eos by full recomputation (float64 model)."""
    cfg = model.cfg
    prev = torch.tensor([[cfg.eos] + toks])
    lp = torch.log_softmax(model(torch.tensor([src]), prev)[0], dim=-1)
    return float(sum(lp[i, t] for i, t in enumerate(toks + [cfg.eos])))


def test_beam_nbest_sorted_distinct_and_scored():
    model = tiny_model("postnorm-sinusoidal-shared", seed=1)
    reqs = _requests(model, n=12, seed=7, max_out=12)
    best = beam_search(model, reqs, beam=5)
    five = beam_search(model, reqs, beam=5, nbest=5, max_batch_size=4)
    assert [h.tokens for h in five] == [h.tokens for h in best]  # nbest changes nothing of the 1-best
    assert [h.score for h in five] == pytest.approx([h.score for h in best], abs=1e-12)  # other batch sizes
    for h, r in zip(five, reqs):
        assert h.nbest[0] == (h.tokens, h.score) and [len(b.nbest) for b in best] == [1] * len(reqs)
        scores = [s for _, s in h.nbest]
        assert scores == sorted(scores, reverse=True)
        assert 1 <= len(h.nbest) <= 5 and len({tuple(t) for t, _ in h.nbest}) == len(h.nbest)
        for toks, score in h.nbest:  # a normalized score is the hypothesis' log-prob incl. eos / len
            assert score == pytest.approx(_naive_score(model, r.src, toks) / (len(toks) + 1), abs=1e-9)
    assert sum(len(h.nbest) == 5 for h in five) >= len(reqs) // 2  # 5 distinct hypotheses where possible
    assert [len(h.nbest) for h in beam_search(model, reqs, beam=5, nbest=2)] == [2] * len(reqs)
    for bad in (0, 6):
        with pytest.raises(ValueError, match="nbest"):
            beam_search(model, reqs, beam=5, nbest=bad)


# -- fairseq checkpoint round trip (no fairseq needed) ----------------------------------------------


def _bundle(model: Transformer) -> Bundle:
    def tok(n):
        return DictionaryTokenizer(Dictionary(SPECIALS + [f"w{i}" for i in range(n - 4)]))
    return Bundle(model=model, src_tok=tok(model.cfg.src_vocab), tgt_tok=tok(model.cfg.tgt_vocab))


@pytest.mark.parametrize("kind", list(FAIRSEQ_CONFIGS))
def test_fairseq_round_trip(kind, tmp_path):
    model = tiny_model(kind, seed=4).float()
    out = save_fairseq(_bundle(model), tmp_path / "fs")
    assert (out / "checkpoint.pt").is_file() and (out / "dict.src.txt").is_file() and (out / "dict.tgt.txt").is_file()
    state = torch.load(out / "checkpoint.pt", weights_only=False)
    assert isinstance(state["cfg"]["model"], argparse.Namespace) and state["cfg"]["model"].arch == "transformer"
    assert state["cfg"]["task"]["source_lang"] == "src" and state["cfg"]["task"]["target_lang"] == "tgt"
    assert "decoder.output_projection.weight" in state["model"]  # fairseq's strict load wants it, tied or not

    back = load_fairseq(out / "checkpoint.pt", out, trust=True)
    assert back.model.cfg == model.cfg
    ref_sd, got_sd = model.state_dict(), back.model.state_dict()
    assert ref_sd.keys() == got_sd.keys()
    for k in ref_sd:
        assert torch.equal(ref_sd[k], got_sd[k]), k
    reqs = _requests(model, n=10, seed=2)
    assert [h.tokens for h in beam_search(back.model, reqs, beam=4)] == [h.tokens for h in beam_search(model, reqs, beam=4)]
    assert _greedy(back.model, reqs) == _greedy(model, reqs)
    assert back.src_tok.dict.symbols == _bundle(model).src_tok.dict.symbols

    proj = convert_fairseq(out / "checkpoint.pt", out, tmp_path / "proj", trust=True)
    from aggdec import checkpoint

    again = checkpoint.load(proj)
    for k, v in again.model.state_dict().items():
        assert torch.equal(v, ref_sd[k]), k


def test_load_fairseq_requires_trust(tmp_path):
    out = save_fairseq(_bundle(tiny_model(seed=0).float()), tmp_path / "fs")
    with pytest.raises(PermissionError, match="pickle.*trust"):
        load_fairseq(out / "checkpoint.pt", out, trust=False)
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        load_fairseq(tmp_path / "nope.pt", out, trust=True)
    (tmp_path / "bad.pt").write_bytes(b"not a pickle at all")
    with pytest.raises(ValueError, match="bad.pt"):
        load_fairseq(tmp_path / "bad.pt", out, trust=True)


def test_load_fairseq_dictionary_mismatch_names_file(tmp_path):
    out = save_fairseq(_bundle(tiny_model(seed=0).float()), tmp_path / "fs")
    with open(out / "dict.tgt.txt", "a", encoding="utf-8") as f:
        f.write("extra 1\n")
    with pytest.raises(ValueError, match=r"dict\.tgt\.txt.*14 entries.*13 rows"):
        load_fairseq(out / "checkpoint.pt", out, trust=True)
    (out / "dict.src.txt").unlink()
    with pytest.raises(FileNotFoundError, match="dict.src.txt"):
        load_fairseq(out / "checkpoint.pt", out, trust=True)


def _edit_checkpoint(path, **fields):
    state = torch.load(path, weights_only=False)
    for k, v in fields.items():
        setattr(state["cfg"]["model"], k, v)
    torch.save(state, path)


@pytest.mark.parametrize("field,value", [("adaptive_softmax_cutoff", "10,20"), ("adaptive_input", True),
                                         ("cross_self_attention", True), ("decoder_output_dim", 8),
                                         ("activation_fn", "gelu_fast"), ("arch", "lstm")])
def test_load_fairseq_refuses_unsupported(tmp_path, field, value):
    out = save_fairseq(_bundle(tiny_model(seed=0).float()), tmp_path / "fs")
    _edit_checkpoint(out / "checkpoint.pt", **{field: value})
    with pytest.raises(ValueError, match=field if field != "arch" else "architecture 'lstm'"):
        load_fairseq(out / "checkpoint.pt", out, trust=True)


def test_load_fairseq_legacy_args_and_arch_defaults(tmp_path):
    """Legacy `args` checkpoints with only some fields: the named architecture's defaults fill in."""
    cfg = ModelConfig(src_vocab=12, tgt_vocab=12, d_model=64, enc_layers=2, dec_layers=2, enc_heads=2, dec_heads=2,
                      enc_ffn=64, dec_ffn=64, max_source_positions=1024, max_target_positions=1024)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    out = save_fairseq(_bundle(model), tmp_path / "fs")
    state = torch.load(out / "checkpoint.pt", weights_only=False)
    state["args"] = argparse.Namespace(arch="transformer_tiny", task="translation", source_lang="src",
                                       target_lang="tgt", dropout=0.0)
    state["cfg"] = None
    torch.save(state, out / "checkpoint.pt")
    back = load_fairseq(out / "checkpoint.pt", out, trust=True)
    assert back.model.cfg == cfg.__class__(**{**cfg.to_dict(), "dropout": 0.0})


def test_save_fairseq_sentencepiece_project_model(tiny_model_dir, tmp_path):
    """Project (sentencepiece) model -> fairseq dicts listing the pieces in id order, ids unchanged."""
    from aggdec import checkpoint

    proj = checkpoint.load(tiny_model_dir)
    out = save_fairseq(tiny_model_dir, tmp_path / "fs")
    sp = proj.src_tok.sp
    lines = (out / "dict.src.txt").read_text(encoding="utf-8").splitlines()
    assert [ln.rsplit(" ", 1)[0] for ln in lines] == [sp.id_to_piece(i) for i in range(4, sp.get_piece_size())]
    assert (out / "spm.model").is_file()
    back = load_fairseq(out / "checkpoint.pt", out, trust=True, bpe="sentencepiece", bpe_model=out / "spm.model")
    text = "The cat goes to school today ."
    assert back.src_tok.encode(text) == proj.src_tok.encode(text)
    reqs = [Request(0, proj.src_tok.encode(text) + [2], 20)]
    assert beam_search(back.model, reqs)[0].tokens == beam_search(proj.model, reqs)[0].tokens


def test_dictionary_overwrite_maps_to_the_later_id(tmp_path):
    from aggdec.tokenizers.dictionary import Dictionary

    p = tmp_path / "dict.txt"
    p.write_text("hello 5\nworld 3\nhello 1 #fairseq:overwrite\n", encoding="utf-8")
    d = Dictionary.load(p)
    assert len(d) == 7 and d.index("hello") == 6 and d.index("world") == 5 and d.index("nope") == 3
