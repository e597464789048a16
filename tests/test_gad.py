"""GAD (draft head), GAD++ and blockwise heads in the shared loop: exact-match acceptance is lossless
for any drafter."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_loop import RandomBudget
from tiny_models import tiny_model

from aggdec.decoding.acceptance import ExactMatch, TopKTolerance
from aggdec.decoding.blockwise import BlockwiseHeads
from aggdec.decoding.budget import DraftBudget
from aggdec.decoding.drafters import NoDraft
from aggdec.decoding.gad_head import DraftHeadDrafter
from aggdec.decoding.metadata import Request
from aggdec.decoding.slot_loop import SlotLoop
from aggdec.model.draft_head import DraftHead, DraftHeadConfig
from aggdec.model.heads import ProposalHeads


def _requests(rng, n, vocab, eos):
    out = []
    for i in range(n):
        length = rng.choice([0, 1, rng.randint(2, 12), 30])
        src = [rng.randint(4, vocab - 1) for _ in range(length)] + [eos]
        out.append(Request(i, src, min(60, rng.randint(1, 2 * length + 6))))
    return out


def _tokens(loop, reqs):
    return {h.index: h.tokens for h in loop.run(reqs)}


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6), bs=st.integers(1, 6), k=st.integers(1, 6), vocab=st.sampled_from([0, 4]),
       layers=st.integers(1, 2), budget=st.sampled_from([None, "random", "measured"]))
def test_draft_head_equals_greedy(seed, bs, k, vocab, layers, budget):
    """The draft head's drafts, at any draft lengths the budget picks (0 included), leave greedy's output."""
    verifier = tiny_model("shallow-decoder-tied-output", vocab=9)
    rng = random.Random(seed)
    reqs = _requests(rng, rng.randint(1, 8), 9, verifier.cfg.eos)
    greedy = _tokens(SlotLoop(verifier, NoDraft(), max_batch_size=4), reqs)
    torch.manual_seed(seed)
    head = DraftHead(DraftHeadConfig(d_model=16, heads=2, ffn=24, layers=layers, block_size=k,
                                     draft_vocab=vocab)).double().eval()
    if vocab:
        head.vocab.copy_(torch.tensor([2, 4, 5, 6]))
    budgets = {None: None, "random": RandomBudget(seed, k), "measured": DraftBudget(k, block=2)}
    loop = SlotLoop(verifier, DraftHeadDrafter(verifier, head), max_batch_size=bs, budget=budgets[budget])
    assert _tokens(loop, reqs) == greedy


def test_gad_plus_plus_beta1_equals_gad_and_tolerance_accepts_more():
    verifier = tiny_model("shallow-decoder-tied-output", vocab=9)
    reqs = _requests(random.Random(3), 10, 9, verifier.cfg.eos)
    torch.manual_seed(3)
    head = DraftHead(DraftHeadConfig(d_model=16, heads=2, ffn=24, layers=1, block_size=6)).double().eval()

    def run(acc):
        loop = SlotLoop(verifier, DraftHeadDrafter(verifier, head), acc, max_batch_size=4)
        hyps = list(loop.run(reqs))
        return {h.index: h.tokens for h in hyps}, sum(h.stats.accepted for h in hyps)

    gad, acc_gad = run(ExactMatch())
    one, acc_one = run(TopKTolerance(beta=1, tau=10.0))
    assert one == gad and acc_one == acc_gad
    _, acc_loose = run(TopKTolerance(beta=5, tau=100.0))
    assert acc_loose > acc_gad


@pytest.mark.parametrize("k,kind", [(2, "prenorm-learned-separate"), (4, "prenorm-learned-separate"), (3, "marian-like")])
def test_blockwise_equals_greedy(k, kind):
    verifier = tiny_model(kind)
    reqs = _requests(random.Random(k), 10, verifier.cfg.src_vocab, verifier.cfg.eos)
    greedy = _tokens(SlotLoop(verifier, NoDraft(), max_batch_size=3), reqs)
    torch.manual_seed(0)
    heads = ProposalHeads(verifier.cfg.d_model, k - 1, 32).double()
    with torch.no_grad():
        heads.fc2.normal_(std=0.3)
    for bs in (1, 4):
        assert _tokens(SlotLoop(verifier, BlockwiseHeads(verifier, heads), max_batch_size=bs), reqs) == greedy
        # draft lengths below k - 1 run only the first heads
        ran, forward = [], heads.forward
        heads.forward = lambda h, num=None: (ran.append(num), forward(h, num))[1]
        loop = SlotLoop(verifier, BlockwiseHeads(verifier, heads), max_batch_size=bs, budget=RandomBudget(bs, k - 1))
        assert _tokens(loop, reqs) == greedy
        del heads.forward
        assert set(ran) == set(range(1, k)), ran


def test_blockwise_block_size_uses_the_first_heads():
    verifier = tiny_model("prenorm-learned-separate")
    reqs = _requests(random.Random(7), 10, verifier.cfg.src_vocab, verifier.cfg.eos)
    greedy = _tokens(SlotLoop(verifier, NoDraft(), max_batch_size=3), reqs)
    torch.manual_seed(1)
    heads = ProposalHeads(verifier.cfg.d_model, 5, 32).double()
    with torch.no_grad():
        heads.fc2.normal_(std=0.3)
    h = torch.randn(4, verifier.cfg.d_model, dtype=torch.float64)
    assert torch.allclose(heads(h, 2), heads(h)[:, :2], atol=1e-12)
    loop = SlotLoop(verifier, BlockwiseHeads(verifier, heads, block_size=3), max_batch_size=4)
    hyps = list(loop.run(reqs))
    assert {x.index: x.tokens for x in hyps} == greedy
    assert max(n for x in hyps for n in x.stats.accepted_per_iter) == 2
    # k-1 = 2 proposals per call after the first (fewer only where max_len leaves less room)
    assert all(x.stats.drafted <= 2 * (x.stats.iterations - 1) for x in hyps)
    assert any(2 in x.stats.accepted_per_iter for x in hyps)
    with pytest.raises(ValueError, match="block size"):
        BlockwiseHeads(verifier, heads, block_size=1)
