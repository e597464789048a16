"""Acceptance criteria on packed logits, against a per-row reference."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aggdec.decoding.acceptance import (
    ExactMatch,
    FixedScores,
    MinBlock,
    TopKTolerance,
    VerifierScores,
    constrain_logits,
)
from aggdec.model.projection import OutputProjection


def _case(seed, bsz, k, vocab):
    g = torch.Generator().manual_seed(seed)
    num = torch.randint(0, k + 1, (bsz,), generator=g)
    logits = torch.randn(bsz, k + 1, vocab, generator=g, dtype=torch.float64)
    pred = logits.argmax(-1)
    draft = torch.randint(0, vocab, (bsz, k), generator=g)
    keep = torch.rand(bsz, k, generator=g) < 0.7  # make long accepted runs likely
    draft = torch.where(keep, pred[:, :k], draft)
    valid = torch.arange(k + 1)[None] <= num[:, None]
    return draft, num, logits, valid


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 10**6), bsz=st.integers(1, 6), k=st.integers(0, 7), vocab=st.integers(2, 9))
def test_exact_match_reference(seed, bsz, k, vocab):
    draft, num, logits, valid = _case(seed, bsz, k, vocab)
    m, bonus = ExactMatch().accept(draft, num, VerifierScores.of(logits[valid]), valid)
    for b in range(bsz):
        ref = 0
        while ref < num[b] and int(logits[b, ref].argmax()) == int(draft[b, ref]):
            ref += 1
        assert int(m[b]) == ref
        assert int(bonus[b]) == int(logits[b, ref].argmax())


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 10**6), bsz=st.integers(1, 6), k=st.integers(0, 7), vocab=st.integers(2, 9),
       tau=st.floats(0, 5))
def test_topk_tolerance(seed, bsz, k, vocab, tau):
    draft, num, logits, valid = _case(seed, bsz, k, vocab)
    packed = VerifierScores.of(logits[valid])
    exact = ExactMatch().accept(draft, num, packed, valid)
    one = TopKTolerance(beta=1, tau=tau).accept(draft, num, packed, valid)
    assert torch.equal(exact[0], one[0]) and torch.equal(exact[1], one[1])  # GAD++ with beta=1 is GAD
    beta = min(3, vocab)
    m, bonus = TopKTolerance(beta=beta, tau=tau).accept(draft, num, packed, valid)
    logp = torch.log_softmax(logits, -1)
    for b in range(bsz):
        ref = 0
        while ref < num[b]:
            lp = logp[b, ref]
            d = int(draft[b, ref])
            rank = int((lp > lp[d]).sum())
            if rank >= beta or float(lp.max() - lp[d]) > tau:
                break
            ref += 1
        assert int(m[b]) == ref >= int(exact[0][b])
        assert int(bonus[b]) == int(logits[b, ref].argmax())


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 10**6), bsz=st.integers(1, 6), k=st.integers(0, 7), vocab=st.integers(4, 9),
       beta=st.integers(1, 4), tau=st.floats(0, 5), min_block=st.integers(0, 3), forced=st.integers(0, 3))
def test_fixed_layout_equals_packed(seed, bsz, k, vocab, beta, tau, min_block, forced):
    """Each rule decides the same on every position of every row (valid None, `FixedScores`: the slot
    loop's step, constrained there without host reads) as on the packed valid positions."""
    draft, num, logits, valid = _case(seed, bsz, k, vocab)
    g = torch.Generator().manual_seed(seed)
    out_index = torch.randint(0, 4, (bsz, 1), generator=g) + torch.arange(k + 1)
    max_len = torch.randint(1, k + 5, (bsz, 1), generator=g)
    rules = (out_index, max_len, 1, 2, 1, torch.randint(3, vocab, (forced,), generator=g))
    packed = constrain_logits(logits.clone(), out_index.expand_as(valid), max_len.expand_as(valid), *rules[2:])
    for rule in (ExactMatch(), TopKTolerance(beta, tau)):
        rule = MinBlock.around(rule, min_block)
        m, bonus = rule.accept(draft, num, VerifierScores.of(packed[valid]), valid)
        fixed = rule.accept(draft, num, FixedScores(logits.clone(), *rules), None)
        assert torch.equal(m, fixed[0]) and torch.equal(bonus, fixed[1])


def test_topk_tolerance_never_accepts_a_token_the_rules_forbid():
    """Where the constrained logits have fewer finite tokens than beta (a forced first token), top-k
    with no gap limit (blockwise `top_k_accept`) still takes only the allowed token."""
    logits = torch.randn(1, 2, 6, dtype=torch.float64)
    constrain_logits(logits, torch.tensor([[0, 1]]), torch.tensor([[9, 9]]), pad=1, eos=2, forced=torch.tensor([4, 5]))
    valid = torch.ones(1, 2, dtype=torch.bool)
    for d in range(6):
        m, _ = TopKTolerance(3, math.inf).accept(torch.tensor([[d]]), torch.tensor([1]), VerifierScores.of(logits[0]),
                                                 valid)
        assert m.tolist() == [int(d == 4)]


def test_topk_tolerance_reads_the_top1_alone_where_nothing_was_drafted():
    """A call without drafts (a greedy step under a draft budget) gets its bonus from the top-1, as
    ExactMatch does, without the full log-softmax; a call with a draft reads the full logits."""
    g = torch.Generator().manual_seed(0)
    projection = OutputProjection(torch.randn(11, 8, generator=g), certify=False)
    hidden = torch.randn(3, 8, generator=g)
    draft, valid = torch.zeros(3, 2, dtype=torch.long), torch.tensor([[True, False, False]] * 3)
    scores = VerifierScores(projection, hidden, lambda z, rows: None)
    m, bonus = TopKTolerance(beta=3, tau=1.0).accept(draft, torch.zeros(3, dtype=torch.long), scores, valid)
    assert "logits" not in scores.__dict__
    assert m.tolist() == [0, 0, 0] and bonus.tolist() == (hidden @ projection.weight.T).argmax(-1).tolist()
    valid[0, 1] = True
    scores = VerifierScores(projection, torch.randn(4, 8, generator=g), lambda z, rows: None)
    TopKTolerance(beta=3, tau=1.0).accept(draft, torch.tensor([1, 0, 0]), scores, valid)
    assert "logits" in scores.__dict__


def test_constrain_logits_rules():
    logits = torch.zeros(3, 6)
    logits[:, 4] = 1.0
    out_index = torch.tensor([0, 3, 5])
    max_len = torch.tensor([5, 5, 5])
    constrain_logits(logits, out_index, max_len, pad=1, eos=2, min_len=1)
    assert math.isinf(logits[0, 2]) and logits[0, 2] < 0  # no eos at index 0
    assert logits[1].argmax() == 4 and math.isinf(logits[1, 1])  # pad never
    assert logits[2].argmax() == 2 and torch.isinf(logits[2, [0, 1, 3, 4, 5]]).all()  # forced eos
