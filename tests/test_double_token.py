"""Double-token bidirectional decoding: the folded order, the pair-causal model, the shared loop
(greedy and draft -> verify, lossless w.r.t. the model's own greedy pairs) and beam over pairs."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_loop import GuideDrafter, RandomBudget, _decode, _requests
from tiny_models import tiny_model

from aggdec.decoding.drafters import NoDraft
from aggdec.decoding.iad import InputCopy
from aggdec.decoding.pair_beam import pair_beam_search
from aggdec.double_token import fold, unfold
from aggdec.model.config import ModelConfig
from aggdec.train.ar import collate, to_double_token

EOD = 2


def test_fold_is_the_papers_order_and_unfold_inverts_it():
    we, will, go, to, tokyo, dot = 10, 11, 12, 13, 14, 15  # "We will go to Tokyo ." (the paper's Figure 2)
    assert fold([we, will, go, to, tokyo, dot], EOD) == [we, dot, will, tokyo, go, to, EOD, EOD]
    assert fold([we, will, go], EOD) == [we, go, will, EOD]
    assert fold([], EOD) == [EOD, EOD]
    rng = random.Random(0)
    for _ in range(200):
        y = [rng.randint(3, 30) for _ in range(rng.randint(0, 20))]
        z = fold(y, EOD)
        assert len(z) % 2 == 0 and z.count(EOD) in (1, 2) and unfold(z, EOD) == y
    assert unfold([5, EOD, 7, 8], EOD) == [5], "a left token before eod is the middle token"
    assert unfold([5, 6, EOD, 9], EOD) == [5, 6], "a right token after a left eod is dropped"
    assert unfold([5, 6, 7, 8], EOD) == [5, 7, 8, 6], "a stream cut short unfolds as far as it goes"


def test_double_token_needs_learned_positions():
    with pytest.raises(ValueError, match="dec_learned_pos"):
        ModelConfig(src_vocab=9, tgt_vocab=9, double_token=True)


@torch.no_grad()
def naive_pair_greedy(model, src, max_len):
    """Greedy over pairs by full recomputation (no cache): each step takes the argmax of both slots."""
    cfg = model.cfg
    out = [cfg.bos, cfg.eos]
    while True:
        logits = model(torch.tensor([src]), torch.tensor([out]))[0, -2:].clone()  # (2, V)
        for slot in range(2):
            j = len(out) - 2 + slot  # stream index this slot predicts
            logits[slot, cfg.pad] = -float("inf")
            if j < 1:
                logits[slot, cfg.eos] = -float("inf")
            if j >= max_len:
                logits[slot] = -float("inf")
                logits[slot, cfg.eos] = 0.0
        pair = logits.argmax(dim=-1).tolist()
        out += pair
        if cfg.eos in pair:
            return unfold(out[2:], cfg.eos)


def test_pair_mask_sees_the_whole_pair():
    """Changing a pair's right token changes its left position's output (same step), never an earlier pair's."""
    model = tiny_model("double-token")
    src = torch.tensor([[5, 6, 7, 2]])
    a = model(src, torch.tensor([[0, 2, 5, 6, 7, 8]]))
    b = model(src, torch.tensor([[0, 2, 5, 9, 7, 8]]))
    assert torch.equal(a[0, :2], b[0, :2])
    assert not torch.allclose(a[0, 2], b[0, 2])


def test_greedy_loop_equals_naive_pairs():
    model = tiny_model("double-token")
    reqs = _requests(random.Random(1), 14, model.cfg.src_vocab, model.cfg.eos)
    ref = {r.index: naive_pair_greedy(model, r.src, r.max_len) for r in reqs}
    assert len({tuple(t) for t in ref.values()}) > 5, "outputs vary"
    for bs in (1, 4):
        got = _decode(model, NoDraft(), reqs, max_batch_size=bs)
        assert {i: h.tokens for i, h in got.items()} == ref
        for r in reqs:  # one call per pair: half the calls of single-token greedy
            assert got[r.index].stats.iterations == len(fold(ref[r.index], model.cfg.eos)) // 2
            assert len(got[r.index].tokens) <= r.max_len
    # an exact draft of the folded stream is accepted in whole pairs: fewer calls, same output
    guides = {r.index: [model.cfg.bos] + fold(ref[r.index], model.cfg.eos) for r in reqs}
    got = _decode(model, GuideDrafter(guides, 4), reqs, max_batch_size=3)
    assert {i: h.tokens for i, h in got.items()} == ref
    for r in reqs:
        pairs = len(fold(ref[r.index], model.cfg.eos)) // 2
        assert got[r.index].stats.iterations == -(-pairs // 3)  # 2 drafted pairs + the bonus pair per call


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6), bs=st.integers(1, 6), refill=st.booleans(), k=st.integers(1, 7),
       budget=st.sampled_from([None, "random"]), drafter=st.sampled_from(["guide", "iad"]))
def test_draft_verify_on_a_double_token_verifier_is_lossless(seed, bs, refill, k, budget, drafter):
    """Drafts (a corrupted copy of the folded greedy stream, or IAD's input copy) verified by whole
    pairs give the double-token model's own greedy output, for any batch, refill order and budget."""
    model = tiny_model("double-token", seed=seed % 5)
    rng = random.Random(seed)
    reqs = _requests(rng, rng.randint(1, 9), model.cfg.src_vocab, model.cfg.eos)
    rng.shuffle(reqs)
    greedy = {i: h.tokens for i, h in _decode(model, NoDraft(), reqs, max_batch_size=3).items()}
    guides = {}
    for r in reqs:
        stream = [model.cfg.bos] + fold(greedy[r.index], model.cfg.eos)  # GuideDrafter reads guide[out_len - 1:]
        guides[r.index] = [t if rng.random() < 0.8 else rng.randint(3, model.cfg.tgt_vocab - 1) for t in stream]
    d = GuideDrafter(guides, k) if drafter == "guide" else InputCopy(max_draft=k)
    budgets = {None: None, "random": RandomBudget(seed, 6)}
    got = _decode(model, d, reqs, max_batch_size=bs, refill=refill, budget=budgets[budget])
    assert {i: h.tokens for i, h in got.items()} == greedy


def test_pair_beam_of_one_is_greedy_and_scores_are_the_stream_log_probs():
    model = tiny_model("double-token", seed=3)
    reqs = _requests(random.Random(2), 10, model.cfg.src_vocab, model.cfg.eos)
    greedy = {i: h.tokens for i, h in _decode(model, NoDraft(), reqs, max_batch_size=4).items()}
    one = pair_beam_search(model, reqs, beam=1, max_batch_size=3)
    assert {r.index: h.tokens for r, h in zip(reqs, one)} == greedy
    four = pair_beam_search(model, reqs, beam=4, max_batch_size=3, nbest=3)
    assert any(h.tokens != greedy[r.index] for r, h in zip(reqs, four)), "beam finds other outputs"
    for r, h in zip(reqs, four):
        assert h.nbest[0] == (h.tokens, h.score) and len(h.nbest) <= 3
        assert [s for _, s in h.nbest] == sorted((s for _, s in h.nbest), reverse=True)
        assert len(h.tokens) <= r.max_len
        # the score is the log-prob of the folded output's slots
        for toks, score in h.nbest:
            if len(toks) >= r.max_len - 1:
                continue  # the limit forced the last pair
            stream = fold(toks, model.cfg.eos)
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([r.src]), torch.tensor([[0, 2, *stream[:-2]]]))[0], -1)
            logp[:, model.cfg.pad] = -float("inf")
            slots = logp.gather(1, torch.tensor(stream)[:, None])[:, 0]
            if len(toks) % 2 == 0:  # a left eod closes with the right slot's best token
                slots[-1] = logp[-1].max()
            assert score == pytest.approx(float(slots.sum()) / (len(toks) + 1), abs=1e-9)


def test_collate_folds_targets_and_conversion_keeps_weights():
    import numpy as np

    src, tgt = [np.array([5, 6], dtype=np.int32)], [np.array([7, 8, 9], dtype=np.int32)]
    s, prev, target = collate(src, tgt, [0], double_token=True)
    assert target.tolist() == [[7, 9, 8, 2]] and prev.tolist() == [[0, 2, 7, 9]] and s.tolist() == [[5, 6, 2]]
    single = tiny_model("postnorm-sinusoidal-shared").float()
    double = to_double_token(single)
    assert double.cfg.double_token and double.cfg.dec_learned_pos
    assert torch.equal(double.decoder.embed_positions.weight, single.decoder.embed_positions.table)
    assert torch.equal(double.encoder.layers[0].fc1.weight, single.encoder.layers[0].fc1.weight)


def test_a_trained_double_token_model_through_the_api_cli_and_a_corpus_job(double_token_dir, tmp_path):
    """A model made by `aggdec train ar --init-from ... --double-token` decodes in pairs everywhere."""
    from click.testing import CliRunner
    from conftest import synthetic_sentences
    from test_jobs import run_on_new_ray, write_corpus, write_spec

    from aggdec import checkpoint
    from aggdec.api import Translator
    from aggdec.fairseq_io import save_fairseq
    from cli import main
    from jobs.spec import load_spec

    tr = Translator.load(double_token_dir)
    assert tr.cfg.double_token
    src = synthetic_sentences(24, seed=5)
    greedy = tr.translate_batch(src, method="greedy", max_batch_size=5)
    texts = [r.text for r in greedy]
    assert len(set(texts)) > 12, "outputs vary"
    for r in greedy:
        assert r.text == tr.bundle.tgt_tok.decode(r.tokens)
        if r.status == "ok":
            assert r.stats.iterations == len(fold(r.tokens, tr.cfg.eos)) // 2, "one call per pair"
    assert [r.text for r in tr.translate_batch(src, method="iad", max_batch_size=7)] == texts, "lossless"
    assert [r.text for r in tr.translate_batch(src, method="beam", beam=1, max_batch_size=4)] == texts
    beam = tr.translate_batch(src, method="beam", beam=4, max_batch_size=4)
    assert all(r.score is not None and r.score <= 0 for r in beam)
    tr.rescore(greedy)
    assert all(r.score is not None and r.score < 0 for r in greedy)

    res = CliRunner().invoke(main, ["decode", "-m", str(double_token_dir), "--batch-size", "3"],
                             input="\n".join(src[:6]) + "\n")
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines() == texts[:6]

    inp = write_corpus(tmp_path / "in", shards=2, rows=6)
    spec = load_spec(write_spec(tmp_path / "job.toml", double_token_dir, inp, tmp_path / "out",
                                decode={"method": '"greedy"'}, resources={"actors": "1"}))
    result, table = run_on_new_ray(spec, tmp_path / "out")
    assert result.rows == table.num_rows == 12
    want = tr.translate_batch(table.column("src").to_pylist(), spec.decode)
    assert table.column("hyp").to_pylist() == [r.text for r in want]

    with pytest.raises(ValueError, match="double_token=True has no fairseq"):
        save_fairseq(checkpoint.load(double_token_dir), tmp_path / "fs")
