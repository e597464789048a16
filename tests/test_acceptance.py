"""Acceptance criteria on a call's verified tokens, against a per-row reference."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aggdec.decoding.acceptance import ExactMatch, MinBlock, TopKTolerance, VerifierScores, constrain_logits
from aggdec.model.projection import OutputProjection, Rules
from aggdec.model.slots import Tokens


def _tokens(keep: torch.Tensor | None, shape=None) -> Tokens:
    """The tokens of a (B, T) grid where `keep` holds (None: all of `shape`)."""
    b, t = keep.shape if keep is not None else shape
    return Tokens.of(torch.zeros(b, t, dtype=torch.long), torch.zeros(b, dtype=torch.long), keep)


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
    m, bonus = ExactMatch().accept(draft, num, VerifierScores.of(logits[valid]), _tokens(valid))
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
    packed, tokens = VerifierScores.of(logits[valid]), _tokens(valid)
    exact = ExactMatch().accept(draft, num, packed, tokens)
    one = TopKTolerance(beta=1, tau=tau).accept(draft, num, packed, tokens)
    assert torch.equal(exact[0], one[0]) and torch.equal(exact[1], one[1])  # GAD++ with beta=1 is GAD
    beta = min(3, vocab)
    m, bonus = TopKTolerance(beta=beta, tau=tau).accept(draft, num, packed, tokens)
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
def test_every_position_decides_as_the_live_ones(seed, bsz, k, vocab, beta, tau, min_block, forced):
    """Each rule decides the same from the scores of every position of every row (a fixed-shape step's
    tokens) as from the live positions alone (an eager step's), top-1 (`Rules.mask` and `override`) and
    full logits (`Rules.apply`) alike."""
    draft, num, _, valid = _case(seed, bsz, k, vocab)
    g = torch.Generator().manual_seed(seed)
    projection = OutputProjection(torch.randn(vocab, 5, generator=g, dtype=torch.float64), certify=False)
    hidden = torch.randn(bsz, k + 1, 5, generator=g, dtype=torch.float64)
    out_index = (torch.randint(0, 4, (bsz, 1), generator=g) + torch.arange(k + 1)).expand_as(valid)
    max_len = torch.randint(1, k + 5, (bsz, 1), generator=g).expand_as(valid)
    rules = (1, 2, 1, torch.randint(3, vocab, (forced,), generator=g))
    for rule in (ExactMatch(), TopKTolerance(beta, tau)):
        rule = MinBlock.around(rule, min_block)
        live = VerifierScores(projection, hidden[valid], Rules(out_index[valid], max_len[valid], *rules))
        m, bonus = rule.accept(draft, num, live, _tokens(valid))
        every = VerifierScores(projection, hidden.flatten(0, 1), Rules(out_index.flatten(), max_len.flatten(), *rules))
        full = rule.accept(draft, num, every, _tokens(None, valid.shape))
        assert torch.equal(m, full[0]) and torch.equal(bonus, full[1])
        top1 = constrain_logits(hidden[valid] @ projection.weight.T, out_index[valid], max_len[valid], *rules).argmax(-1)
        assert torch.equal(live.top1, top1)  # the masked argmax under the override: the constrained one


def test_topk_tolerance_never_accepts_a_token_the_rules_forbid():
    """Where the constrained logits have fewer finite tokens than beta (a forced first token), top-k
    with no gap limit (blockwise `top_k_accept`) still takes only the allowed token."""
    logits = torch.randn(1, 2, 6, dtype=torch.float64)
    constrain_logits(logits, torch.tensor([[0, 1]]), torch.tensor([[9, 9]]), pad=1, eos=2, forced=torch.tensor([4, 5]))
    for d in range(6):
        m, _ = TopKTolerance(3, math.inf).accept(torch.tensor([[d]]), torch.tensor([1]), VerifierScores.of(logits[0]),
                                                 _tokens(None, (1, 2)))
        assert m.tolist() == [int(d == 4)]


def test_topk_tolerance_reads_the_top1_alone_where_nothing_was_drafted():
    """A call without drafts (a greedy step under a draft budget: the loop verifies no draft column)
    gets its bonus from the top-1, as ExactMatch does, without the full log-softmax; a call with a
    draft reads the full logits."""
    g = torch.Generator().manual_seed(0)
    projection = OutputProjection(torch.randn(11, 8, generator=g), certify=False)
    hidden = torch.randn(3, 8, generator=g)
    rules = Rules(torch.zeros(3, dtype=torch.long), torch.full((3,), 9), pad=1, eos=2, min_len=0)
    scores = VerifierScores(projection, hidden, rules)
    draft = torch.zeros(3, 0, dtype=torch.long)
    m, bonus = TopKTolerance(beta=3, tau=1.0).accept(draft, torch.zeros(3, dtype=torch.long), scores, _tokens(None, (3, 1)))
    assert scores._logits is None
    want = (hidden @ projection.weight.T).index_fill(1, torch.tensor([1]), -math.inf).argmax(-1)
    assert m.tolist() == [0, 0, 0] and bonus.tolist() == want.tolist()
    keep = torch.tensor([[True, True], [True, False], [True, False]])
    rules = Rules(torch.zeros(4, dtype=torch.long), torch.full((4,), 9), pad=1, eos=2)
    scores = VerifierScores(projection, torch.randn(4, 8, generator=g), rules)
    TopKTolerance(beta=3, tau=1.0).accept(draft[:, :0].new_zeros(3, 1), torch.tensor([1, 0, 0]), scores, _tokens(keep))
    assert scores._logits is not None


def test_constrain_logits_rules():
    logits = torch.zeros(3, 6)
    logits[:, 4] = 1.0
    out_index = torch.tensor([0, 3, 5])
    max_len = torch.tensor([5, 5, 5])
    constrain_logits(logits, out_index, max_len, pad=1, eos=2, min_len=1)
    assert math.isinf(logits[0, 2]) and logits[0, 2] < 0  # no eos at index 0
    assert logits[1].argmax() == 4 and math.isinf(logits[1, 1])  # pad never
    assert logits[2].argmax() == 2 and torch.isinf(logits[2, [0, 1, 3, 4, 5]]).all()  # forced eos
