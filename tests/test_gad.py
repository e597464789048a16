"""GAD (NAR block drafter), GAD++ and blockwise heads in the shared loop: exact-match acceptance is
lossless for any drafter; the drafter's cached block layout equals its teacher-forced layout."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiny_models import tiny_model

from aggdec.decoding.acceptance import ExactMatch, TopKTolerance
from aggdec.decoding.blockwise import BlockwiseHeads
from aggdec.decoding.budget import DraftBudget
from aggdec.decoding.gad_head import DraftHeadDrafter
from aggdec.decoding.drafters import NoDraft
from aggdec.decoding.loop import DraftVerifyLoop
from aggdec.decoding.metadata import Request
from aggdec.decoding.nat import NATDrafter, block_layout
from aggdec.model.draft_head import DraftHead, DraftHeadConfig
from aggdec.model.heads import ProposalHeads
from test_loop import RandomBudget


def _drafter(verifier, seed=1):
    v = verifier.cfg.tgt_vocab
    return tiny_model("prenorm-learned-separate", seed=seed, vocab=verifier.cfg.src_vocab, tgt_vocab=v + 1)


def _requests(rng, n, vocab, eos):
    out = []
    for i in range(n):
        length = rng.choice([0, 1, rng.randint(2, 12), 30])
        src = [rng.randint(4, vocab - 1) for _ in range(length)] + [eos]
        out.append(Request(i, src, min(60, rng.randint(1, 2 * length + 6))))
    return out


def _tokens(loop, reqs):
    return {h.index: h.tokens for h in loop.run(reqs)}


def test_cached_block_layout_equals_full_forward():
    drafter = _drafter(tiny_model())
    mask = drafter.cfg.tgt_vocab - 1
    src = torch.tensor([[5, 6, 7, 8, 2], [9, 4, 2, 1, 1]])
    prefix = torch.tensor([[2, 5, 6, 7], [2, 9, 9, 9]])
    k = 3
    with torch.no_grad():
        # full: [prefix ; masks] in one sequence, masks see each other, prefix causal
        seq = torch.cat([prefix, torch.full((2, k), mask)], dim=1)
        n = torch.tensor([4, 4])
        _, is_mask, key_limit = block_layout(n, torch.tensor([k, k]), torch.zeros(2, dtype=torch.long))
        full = drafter(src, seq, key_limit=key_limit)[is_mask].view(2, k, -1)
        # cached: prefix in two ragged pieces, then masks
        cache = drafter.start(src)
        drafter.decode_hidden(prefix[:, :2], cache)
        cache.commit(torch.tensor([2, 2]))
        n2 = torch.tensor([2, 2])
        is_prefix, is_mask2, limit2 = block_layout(n2, torch.tensor([k, k]), cache.lengths)
        block = torch.cat([prefix[:, 2:], torch.full((2, k), mask)], dim=1)
        hid = drafter.decode_hidden(block, cache, key_limit=limit2)
        got = drafter.output_logits(hid[is_mask2]).view(2, k, -1)
    torch.testing.assert_close(got, full, rtol=0, atol=1e-10)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6), bs=st.integers(1, 6), k=st.integers(1, 8), adaptive=st.booleans())
def test_gad_equals_greedy(seed, bs, k, adaptive):
    verifier = tiny_model("shallow-decoder-tied-output", vocab=9)
    rng = random.Random(seed)
    reqs = _requests(rng, rng.randint(1, 8), 9, verifier.cfg.eos)
    greedy = _tokens(DraftVerifyLoop(verifier, NoDraft(), max_batch_size=4), reqs)
    drafter = _drafter(verifier, seed=seed % 7)
    gad = NATDrafter(drafter, mask_id=drafter.cfg.tgt_vocab - 1, block_size=k, adaptive=adaptive, min_draft=1)
    assert _tokens(DraftVerifyLoop(verifier, gad, max_batch_size=bs), reqs) == greedy


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6), bs=st.integers(1, 6), k=st.integers(1, 6), vocab=st.sampled_from([0, 4]),
       layers=st.integers(1, 2), budget=st.sampled_from([None, "random", "measured"]))
def test_draft_head_equals_greedy(seed, bs, k, vocab, layers, budget):
    """The draft head's drafts, at any draft lengths the budget picks (0 included), leave greedy's output."""
    verifier = tiny_model("shallow-decoder-tied-output", vocab=9)
    rng = random.Random(seed)
    reqs = _requests(rng, rng.randint(1, 8), 9, verifier.cfg.eos)
    greedy = _tokens(DraftVerifyLoop(verifier, NoDraft(), max_batch_size=4), reqs)
    torch.manual_seed(seed)
    head = DraftHead(DraftHeadConfig(d_model=16, heads=2, ffn=24, layers=layers, block_size=k,
                                     draft_vocab=vocab)).double().eval()
    if vocab:
        head.vocab.copy_(torch.tensor([2, 4, 5, 6]))
    budgets = {None: None, "random": RandomBudget(seed, k), "measured": DraftBudget(k, block=2)}
    loop = DraftVerifyLoop(verifier, DraftHeadDrafter(verifier, head), max_batch_size=bs, budget=budgets[budget])
    assert _tokens(loop, reqs) == greedy


def test_gad_plus_plus_beta1_equals_gad_and_tolerance_accepts_more():
    verifier = tiny_model("shallow-decoder-tied-output", vocab=9)
    reqs = _requests(random.Random(3), 10, 9, verifier.cfg.eos)
    drafter = _drafter(verifier)

    def run(acc):
        loop = DraftVerifyLoop(verifier, NATDrafter(drafter, drafter.cfg.tgt_vocab - 1, 6), acc, max_batch_size=4)
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
    greedy = _tokens(DraftVerifyLoop(verifier, NoDraft(), max_batch_size=3), reqs)
    torch.manual_seed(0)
    heads = ProposalHeads(verifier.cfg.d_model, k - 1, 32).double()
    with torch.no_grad():
        heads.fc2.normal_(std=0.3)
    for bs in (1, 4):
        assert _tokens(DraftVerifyLoop(verifier, BlockwiseHeads(verifier, heads), max_batch_size=bs), reqs) == greedy


def test_blockwise_block_size_uses_the_first_heads():
    verifier = tiny_model("prenorm-learned-separate")
    reqs = _requests(random.Random(7), 10, verifier.cfg.src_vocab, verifier.cfg.eos)
    greedy = _tokens(DraftVerifyLoop(verifier, NoDraft(), max_batch_size=3), reqs)
    torch.manual_seed(1)
    heads = ProposalHeads(verifier.cfg.d_model, 5, 32).double()
    with torch.no_grad():
        heads.fc2.normal_(std=0.3)
    h = torch.randn(4, verifier.cfg.d_model, dtype=torch.float64)
    assert torch.allclose(heads(h, 2), heads(h)[:, :2], atol=1e-12)
    loop = DraftVerifyLoop(verifier, BlockwiseHeads(verifier, heads, block_size=3), max_batch_size=4)
    hyps = list(loop.run(reqs))
    assert {x.index: x.tokens for x in hyps} == greedy
    assert max(n for x in hyps for n in x.stats.accepted_per_iter) == 2
    # k-1 = 2 proposals per call after the first (fewer only where max_len leaves less room)
    assert all(x.stats.drafted <= 2 * (x.stats.iterations - 1) for x in hyps)
    assert any(2 in x.stats.accepted_per_iter for x in hyps)
    with pytest.raises(ValueError, match="block size"):
        BlockwiseHeads(verifier, heads, block_size=1)
