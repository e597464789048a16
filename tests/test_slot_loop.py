"""The decode loop (fixed slots, device-side bookkeeping) is lossless in each of its backends (eager packed,
fixed-shape under a replay's rules, compiled), whose fixed-shape step reads the host once per iteration:
greedy, IAD, the draft head (GAD) and proposal heads (blockwise) give naive greedy's output on random
float64 models, for any slot count, token budget, draft length, refill order and reuse of the loop
across runs; every acceptance rule (GAD++, min-block) decides alike packed and fixed."""

import dataclasses
import math
import random

import pytest
import torch
from conftest import compiles
from hypothesis import given, settings
from hypothesis import strategies as st
from test_loop import GuideDrafter, RandomBudget, _decode, _requests
from tiny_models import naive_greedy, tiny_model

from aggdec.decoding.acceptance import ExactMatch, MinBlock, TopKTolerance
from aggdec.decoding.blockwise import BlockwiseHeads
from aggdec.decoding.budget import DraftBudget
from aggdec.decoding.drafters import NoDraft
from aggdec.decoding.gad_head import DraftHeadDrafter
from aggdec.decoding.iad import InputCopy
from aggdec.decoding.metadata import Request
from aggdec.decoding.slot_loop import SlotLoop, capture_plan, slot_count
from aggdec.double_token import fold
from aggdec.model.draft_head import DraftHead, DraftHeadConfig
from aggdec.model.heads import ProposalHeads
from aggdec.thresholds import DRAFT_LONGEST

KINDS = ["postnorm-sinusoidal-shared", "prenorm-learned-separate", "shallow-decoder-tied-output", "marian-like",
         "bart-like", "t5-like", "t5-gated-like"]


def _run(loop, reqs):
    hyps = list(loop.run(reqs))
    assert sorted(h.index for h in hyps) == sorted(r.index for r in reqs), "every request yields exactly one output"
    return {h.index: h for h in hyps}


@pytest.mark.parametrize("kind", KINDS)
def test_slot_greedy_equals_naive_recompute(kind):
    model = tiny_model(kind)
    reqs = _requests(random.Random(1), 10, model.cfg.src_vocab, model.cfg.eos)
    ref = {r.index: naive_greedy(model, r.src, r.max_len) for r in reqs}
    for bs in (1, 3):
        got = _run(SlotLoop(model, NoDraft(), max_batch_size=bs), reqs)
        assert {i: h.tokens for i, h in got.items()} == ref
        for h in got.values():
            assert h.stats.iterations == len(h.tokens) + 1 == len(h.stats.accepted_per_iter)
            assert h.stats.drafted == h.stats.accepted == 0 and h.stats.decode_ms > 0


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10**6), kind=st.sampled_from(KINDS), bs=st.integers(1, 9),
       cap=st.one_of(st.none(), st.integers(1, 6)), adaptive=st.booleans(), substitution=st.booleans(),
       nearest_match=st.booleans(), skip_prefix=st.booleans(), max_tokens=st.one_of(st.none(), st.integers(1, 60)),
       budget=st.booleans(), forced=st.integers(0, 2), encode_batch=st.integers(0, 5))
def test_slot_iad_equals_greedy(seed, kind, bs, cap, adaptive, substitution, nearest_match, skip_prefix, max_tokens,
                                budget, forced, encode_batch):
    model = tiny_model(kind, seed=seed % 5, vocab=9)
    rng = random.Random(seed)
    prompt = tuple(rng.randint(3, model.cfg.tgt_vocab - 1) for _ in range(1 + forced))
    reqs = [r for r in _requests(rng, rng.randint(1, 12), model.cfg.src_vocab, model.cfg.eos, repeat=True)
            if r.max_len > forced]
    rng.shuffle(reqs)
    ref = {r.index: naive_greedy(model, r.src, r.max_len, prompt) for r in reqs}
    fallbacks = dict(substitution=substitution, nearest_match=nearest_match, skip_prefix=skip_prefix)
    drafter = (InputCopy(max_draft=cap or 4, adaptive=True, min_draft=1, **fallbacks) if adaptive
               else InputCopy(max_draft=cap, **fallbacks))
    loop = SlotLoop(model, drafter, max_batch_size=bs, max_tokens=max_tokens, prompt=prompt,
                    encode_batch=encode_batch, budget=RandomBudget(seed, cap or 6) if budget else None)
    for _ in range(2):  # a second run reuses the slots, reset in place
        got = _run(loop, reqs)
        assert {i: h.tokens for i, h in got.items()} == ref
        for h in got.values():
            st_ = h.stats
            assert st_.iterations == len(st_.accepted_per_iter)
            assert st_.accepted == sum(st_.accepted_per_iter) <= st_.drafted
            assert 0 <= st_.iterations + st_.accepted - (len(h.tokens) + 1) <= 1
    if not budget:  # one matcher's drafts on every backend: the fixed-shape step's statistics are the eager step's
        drafter = (InputCopy(max_draft=cap or 4, adaptive=True, min_draft=1, **fallbacks) if adaptive
                   else InputCopy(max_draft=cap, **fallbacks))
        check = _run(SlotLoop(model, drafter, max_batch_size=bs, max_tokens=max_tokens, prompt=prompt,
                              encode_batch=encode_batch, graphs="check"), reqs)
        assert {i: (h.tokens, h.stats.iterations, h.stats.drafted, h.stats.accepted_per_iter)
                for i, h in check.items()} == {i: (h.tokens, h.stats.iterations, h.stats.drafted,
                                                   h.stats.accepted_per_iter) for i, h in got.items()}


def _head_drafter(kind: str, model, k: int, vocab: int = 0):
    """A random draft head (GAD) or proposal heads (blockwise) of `k` drafts on `model`, float64."""
    if kind == "blockwise":
        return BlockwiseHeads(model, ProposalHeads(model.cfg.d_model, k, 32).double().eval())
    head = DraftHead(DraftHeadConfig(d_model=model.cfg.d_model, heads=2, ffn=24, layers=1, block_size=k,
                                     draft_vocab=vocab)).double().eval()
    if vocab:
        head.vocab.copy_(torch.tensor([2, 4, 5, 6][:vocab]))
    return DraftHeadDrafter(model, head)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10**6), kind=st.sampled_from(["gad", "blockwise"]), bs=st.integers(1, 9),
       k=st.integers(1, 5), vocab=st.sampled_from([0, 4]), budget=st.sampled_from([None, "random", "measured"]),
       max_tokens=st.one_of(st.none(), st.integers(1, 60)))
def test_slot_head_drafters_equal_greedy(seed, kind, bs, k, vocab, budget, max_tokens):
    """Drafters that draft from each call's verifier states (`StateDrafter`: the draft head and
    proposal heads) draft after the budget picks the next length, at any lengths it picks (0
    included), and leave greedy's output; a refilled row drafts nothing on its first call."""
    model = tiny_model("shallow-decoder-tied-output", seed=seed % 5, vocab=9)
    rng = random.Random(seed)
    reqs = _requests(rng, rng.randint(1, 12), model.cfg.src_vocab, model.cfg.eos, repeat=True)
    ref = {r.index: naive_greedy(model, r.src, r.max_len) for r in reqs}
    torch.manual_seed(seed)
    drafter = _head_drafter(kind, model, k, vocab)
    budgets = {None: None, "random": RandomBudget(seed, k), "measured": DraftBudget(k, block=2)}
    loop = SlotLoop(model, drafter, max_batch_size=bs, max_tokens=max_tokens, budget=budgets[budget])
    for _ in range(2):  # a second run reuses the slots and the drafter's rows, reset in place
        pending = drafter.rows.pending if drafter.rows.tensors() else None
        got = _run(loop, reqs)
        assert {i: h.tokens for i, h in got.items()} == ref
        for h in got.values():
            st_ = h.stats
            assert st_.iterations == len(st_.accepted_per_iter) and st_.accepted_per_iter[0] == 0
            assert st_.accepted == sum(st_.accepted_per_iter) <= st_.drafted <= k * (st_.iterations - 1)
        assert pending is None or drafter.rows.pending.data_ptr() == pending.data_ptr()


RULES = {"gad++": lambda beta, tau, n: TopKTolerance(beta, tau),
         "minblock": lambda beta, tau, n: MinBlock(ExactMatch(), n),
         "minblock-gad++": lambda beta, tau, n: MinBlock(TopKTolerance(beta, tau), n)}


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10**6), kind=st.sampled_from(["gad", "blockwise"]), rule=st.sampled_from(list(RULES)),
       beta=st.integers(1, 4), tau=st.sampled_from([0.0, 0.3, 1.0, 4.0, math.inf]), min_block=st.integers(1, 4),
       bs=st.integers(1, 9), k=st.integers(1, 6), max_tokens=st.one_of(st.none(), st.integers(1, 60)),
       forced=st.integers(0, 2))
def test_every_backend_runs_one_step_alike(seed, kind, rule, beta, tau, min_block, bs, k, max_tokens, forced):
    """Every acceptance rule decides alike on an eager step's live tokens and on every position of a step
    run under a replay's rules (`graphs="check"`): one output and the same statistics for the same
    drafter at a fixed draft length (lossy rules included: GAD++ top-beta/tau, min-block around exact or
    GAD++), any slot count, refill order and forced prefix, run after run; GAD++ with beta 1 is greedy's
    output. Drafts longer than a short source keep their length."""
    model = tiny_model("shallow-decoder-tied-output", seed=seed % 5, vocab=9)
    rng = random.Random(seed)
    prompt = tuple(rng.randint(3, model.cfg.tgt_vocab - 1) for _ in range(1 + forced))
    reqs = [r for r in _requests(rng, rng.randint(1, 12), model.cfg.src_vocab, model.cfg.eos, max_src=6, repeat=True)
            if r.max_len > forced]
    rng.shuffle(reqs)
    acceptance = RULES[rule](beta, tau, min_block)
    drafters = []
    for _ in range(2):  # the same random weights for both loops
        torch.manual_seed(seed)
        drafters.append(_head_drafter(kind, model, k))
    row = _decode(model, drafters[0], reqs, acceptance=acceptance, max_batch_size=bs, max_tokens=max_tokens,
                  prompt=prompt)
    ref = {i: h.tokens for i, h in row.items()}
    if rule == "gad++" and beta == 1:
        assert ref == {r.index: naive_greedy(model, r.src, r.max_len, prompt) for r in reqs}
    for graphs in (False, "check"):
        loop = SlotLoop(model, drafters[1], acceptance, max_batch_size=bs, max_tokens=max_tokens, prompt=prompt,
                        graphs=graphs)
        for _ in range(2):  # a second run reuses the slots
            got = _run(loop, reqs)
            assert {i: h.tokens for i, h in got.items()} == ref
            stats = [(h.stats.iterations, h.stats.drafted, h.stats.accepted_per_iter) for i in ref
                     for h in (got[i], row[i])]
            assert stats[::2] == stats[1::2]


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10**6), bs=st.integers(1, 6), k=st.integers(1, 7), budget=st.sampled_from([None, "random"]),
       drafter=st.sampled_from(["greedy", "guide", "iad"]))
def test_a_double_token_verifier_decodes_in_pairs(seed, bs, k, budget, drafter):
    """A double-token verifier on slots, eagerly and under a replay's rules: drafts (a corrupted copy of the
    folded greedy stream, IAD's input copy) cut to whole pairs, accepted by whole pairs, a bonus pair and
    the eos cut by pairs give the model's own greedy output for any slot count, refill order and draft
    budget, run after run; and the same statistics (in tokens) packed and fixed where both verify the same
    drafts: at the drafter's length, or at a random budget's eagerly on a power of two of slots."""
    model = tiny_model("double-token", seed=seed % 5)
    rng = random.Random(seed)
    reqs = _requests(rng, rng.randint(1, 9), model.cfg.src_vocab, model.cfg.eos)
    rng.shuffle(reqs)
    greedy = {i: h.tokens for i, h in _decode(model, NoDraft(), reqs, max_batch_size=3).items()}
    guides = {r.index: [t if rng.random() < 0.8 else rng.randint(3, model.cfg.tgt_vocab - 1)
                        for t in [model.cfg.bos] + fold(greedy[r.index], model.cfg.eos)] for r in reqs}
    drafters = {"greedy": NoDraft, "guide": lambda: GuideDrafter(guides, k), "iad": lambda: InputCopy(max_draft=k)}
    budgets = {None: lambda: None, "random": lambda: RandomBudget(seed, k)}
    row = _decode(model, drafters[drafter](), reqs, max_batch_size=bs, budget=budgets[budget]())
    for graphs in (False, "check"):
        loop = SlotLoop(model, drafters[drafter](), max_batch_size=bs, graphs=graphs, budget=budgets[budget]())
        for run in range(2):  # a second run reuses the slots
            got = _run(loop, reqs)
            assert {i: h.tokens for i, h in got.items()} == greedy
            # eager, a call's drafts are cut at its longest source (IAD's longest), which guides pass: fixed
            # shapes verify guides past it
            same = not graphs or drafter != "guide"
            if same and (budget is None or (run == 0 and not graphs and bs & (bs - 1) == 0)):
                stats = [(h.stats.iterations, h.stats.drafted, h.stats.accepted, h.stats.accepted_per_iter)
                         for i in greedy for h in (got[i], row[i])]
                assert stats[::2] == stats[1::2]
    with pytest.raises(ValueError, match="a double-token model takes no forced first tokens"):
        SlotLoop(model, prompt=(2, 5))


def test_slots_are_allocated_once_and_grown_by_doubling(monkeypatch):
    """A loop allocates `slot_count(max_batch_size)` slots at its first run, whatever that run's size;
    later runs that fit (fewer requests, one request) keep their storage, the drafter's row tensors
    included; a longer or wider sentence gets buffers at least twice as long or wide, once, which the
    next short run keeps (buffers from 8 positions here, so that the tiny model's limits allow growing)."""
    from aggdec.decoding import slot_loop

    monkeypatch.setattr(slot_loop, "SLOT_POSITIONS", 8)
    model = tiny_model()
    eos = model.cfg.eos
    loop = SlotLoop(model, InputCopy(max_draft=3), max_batch_size=6)
    short = [Request(index=i, src=[4 + i, 5, 6, eos], max_len=5) for i in range(9)]
    _run(loop, short[:3])
    assert loop._whole_state.batch_size == 8 and loop.counters.allocations == 1
    length, width = loop.cache.length, loop.cache.src_width

    def ptrs():
        return loop._whole_cache.k[0].data_ptr(), loop._whole_state.out.data_ptr(), loop.drafter.rows.resume.data_ptr()

    before = ptrs()
    for run in (short, short[:1], short[4:6]):
        assert {i: h.tokens for i, h in _run(loop, run).items()} == {
            r.index: naive_greedy(model, r.src, r.max_len) for r in run}
        assert ptrs() == before and loop.counters.allocations == 1
    long = [Request(index=0, src=[4] * width + [eos], max_len=length + 2)]
    got = _run(loop, long)
    assert got[0].tokens == naive_greedy(model, long[0].src, long[0].max_len) and loop.counters.allocations == 2
    assert loop.cache.length - 1 >= 2 * (length - 1) and loop.cache.src_width - 1 >= 2 * (width - 1)
    _run(loop, short)
    assert loop.counters.allocations == 2


@pytest.mark.parametrize("drafter", [lambda m: NoDraft(), lambda m: InputCopy(max_draft=3, adaptive=True, min_draft=1),
                                     lambda m: _head_drafter("gad", m, 3)])
def test_the_tail_narrows_to_the_live_rows(drafter):
    """Once no request waits, live rows move into the first slots and the steps run on the power of two
    that holds them (eager: down to 1); outputs and statistics are as on all slots, and the next run gets
    every slot back."""
    model = tiny_model("prenorm-learned-separate", seed=2)
    rng = random.Random(5)
    reqs = _requests(rng, 30, model.cfg.src_vocab, model.cfg.eos)
    reqs[7] = Request(index=reqs[7].index, src=reqs[7].src, max_len=40)  # one long row keeps the tail going
    ref = {r.index: naive_greedy(model, r.src, r.max_len) for r in reqs}
    torch.manual_seed(5)
    loop = SlotLoop(model, drafter(model), max_batch_size=8)
    sizes = []
    step = loop.step
    loop.step = lambda *key: (sizes.append(loop.state.batch_size), step(*key))[1]
    for _ in range(2):
        sizes.clear()
        got = _run(loop, reqs)
        assert {i: h.tokens for i, h in got.items()} == ref
        assert sizes[0] == 8 and sizes[-1] == 1 and sorted(sizes, reverse=True) == sizes
        for h in got.values():
            assert h.stats.iterations == len(h.stats.accepted_per_iter)
            assert h.stats.accepted == sum(h.stats.accepted_per_iter) <= h.stats.drafted


def test_one_host_read_per_iteration(monkeypatch):
    """Outside retiring finished rows and encoding refills, an iteration reads one tensor to the host."""
    from torch.overrides import TorchFunctionMode

    class Reads(TorchFunctionMode):
        n, paused = 0, 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if not Reads.paused and getattr(func, "__name__", "") in {"item", "tolist", "__bool__", "__int__",
                                                                      "__float__", "__index__"}:
                Reads.n += 1
            return func(*args, **(kwargs or {}))

    def paused(method):
        def run(*args, **kwargs):
            Reads.paused += 1
            try:
                out = method(*args, **kwargs)
                return list(out) if method.__name__ == "_retire" else out
            finally:
                Reads.paused -= 1
        return run

    monkeypatch.setattr(SlotLoop, "_retire", paused(SlotLoop._retire))
    monkeypatch.setattr(SlotLoop, "_fill", paused(SlotLoop._fill))
    model = tiny_model()
    reqs = _requests(random.Random(3), 12, model.cfg.src_vocab, model.cfg.eos)
    for drafter in (NoDraft(), InputCopy(max_draft=4, substitution=True, nearest_match=True)):
        loop = SlotLoop(model, drafter, max_batch_size=4, graphs="check")  # the fixed-shape step
        Reads.n = 0
        with Reads():
            list(loop.run(reqs))
        assert Reads.n == loop.counters.calls


class OfferLog(RandomBudget):
    """RandomBudget that keeps what each call reports: (draft length, tokens committed, offered, drafted,
    accepted)."""

    def __init__(self, seed: int, max_length: int):
        super().__init__(seed, max_length)
        self.log: list[tuple[int, int, int | None, int | None, int | None]] = []

    def record(self, length, tokens, seconds, rows=1, offered=None, drafted=None, accepted=None):
        self.log.append((length, tokens, offered, drafted, accepted))
        super().record(length, tokens, seconds, rows, offered, drafted, accepted)


@pytest.mark.parametrize("seed", range(4))
def test_budget_is_told_the_drafts_offered(seed):
    """The loop reports the longest draft offered before its width's cut, from its one read per
    iteration, at every call, and the draft tokens it verified and accepted: in all, the rows' own counts
    (accepted: less the drafted eos a row ends on, counted in its statistics, not as a token after the
    row's last one)."""
    model = tiny_model(KINDS[seed % len(KINDS)], seed=seed, vocab=9)
    reqs = _requests(random.Random(seed), 14, model.cfg.src_vocab, model.cfg.eos, repeat=True)
    budget = OfferLog(seed, DRAFT_LONGEST)
    hyps = list(SlotLoop(model, InputCopy(), max_batch_size=2**seed, budget=budget).run(reqs))
    assert all(offered is not None for _, _, offered, _, _ in budget.log)
    assert any(0 < length < offered for length, _, offered, _, _ in budget.log)  # some drafts were cut
    assert sum(d for *_, d, _ in budget.log) == sum(h.stats.drafted for h in hyps) > 0
    accepted = sum(h.stats.accepted for h in hyps)
    assert accepted - len(hyps) <= sum(a for *_, a in budget.log) <= accepted


def test_slot_count():
    assert [slot_count(n) for n in (0, 1, 2, 3, 48, 63, 64, 65)] == [1, 1, 2, 4, 64, 64, 64, 128]


def test_decode_attention_kernel_equals_masked_softmax():
    """The CPU kernel (built in the test environment) computes the masked softmax of `core` where each
    query sees a prefix of its row's keys: float64 to 1e-12, float32 to 1e-5, on cache-prefix views,
    one and several queries per row, a count broadcast over queries, counts past the keys read
    (clamped), keys read through a row map (`rows`), and NaN where a query sees no key, as the masked
    softmax gives."""
    from aggdec.model import decode_attention
    from aggdec.model.transformer import MultiheadAttention

    assert decode_attention.load(), "the kernel must be installed here (pip install --no-build-isolation -e .)"
    gen = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        for b, t, length, dim, heads in ((1, 1, 5, 16, 4), (5, 1, 37, 32, 2), (3, 4, 9, 64, 4), (2, 3, 20, 24, 3)):
            attn = MultiheadAttention(dim, heads, 0.0).eval()
            q = torch.randn(b, t, 3 * dim, generator=gen, dtype=dtype)[..., :dim]  # a view, as q of a fused q/k/v
            cache = torch.randn(2, b, length + 7, dim, generator=gen, dtype=dtype)
            k, v = cache[0, :, :length], cache[1, :, :length]  # prefixes of a longer cache
            count = torch.randint(1, length + 3, (b, t), generator=gen)
            keep = (torch.arange(length)[None, None, :] < count[:, :, None])[:, None]
            torch.testing.assert_close(decode_attention.attend(q, k, v, count, heads), attn.core(q, k, v, keep),
                                       rtol=tol, atol=tol)
            shared = count[:, :1].expand(b, t)
            keep = (torch.arange(length)[None, None, :] < shared[:, :, None])[:, None]
            torch.testing.assert_close(decode_attention.attend(q, k, v, shared, heads), attn.core(q, k, v, keep),
                                       rtol=tol, atol=tol)
            # keys read through `rows`: a row's key j from any row of a larger buffer, or one row per group
            stored = torch.randn(2, b + 3, length, dim, generator=gen, dtype=dtype)
            for rows in (torch.randint(0, b + 3, (b, length), generator=gen),
                         torch.randint(0, b + 3, (b, 1), generator=gen).expand(b, length)):
                k, v = (t[rows, torch.arange(length)] for t in stored)  # (b, length, dim): what each row reads
                keep = (torch.arange(length)[None, None, :] < count[:, :, None])[:, None]
                torch.testing.assert_close(decode_attention.attend(q, stored[0], stored[1], count, heads, rows),
                                           attn.core(q, k, v, keep), rtol=tol, atol=tol)
    none = decode_attention.attend(q, k, v, torch.zeros_like(count), heads)
    assert none.isnan().all()
    bad = torch.zeros(q.shape[0], k.shape[1], dtype=torch.long)
    bad[-1, 0] = k.shape[0]  # read by every query of the last row
    with pytest.raises(RuntimeError, match="not a row of k"):
        decode_attention.attend(q, k, v, torch.ones_like(count), heads, bad)


def test_decode_attention_kernel_adds_a_score_bias():
    """With a score bias (B,heads,T,L) of any strides (T5's relative positions: a view whose heads
    are not last; one row broadcast over the batch) and a scale of its own (T5's: 1), the kernel
    computes the biased masked softmax of `core`: each query its own row of bias."""
    from aggdec.model import decode_attention
    from aggdec.model.transformer import MultiheadAttention

    assert decode_attention.load()
    gen = torch.Generator().manual_seed(2)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        for b, t, length, heads, scaled in ((1, 1, 5, 4, False), (3, 4, 9, 2, True), (2, 3, 20, 3, False)):
            attn = MultiheadAttention(16, heads, 0.0, head_dim=5, bias=False, scaled=scaled).eval()
            dim = heads * 5
            q, k, v = (torch.randn(b, n, dim, generator=gen, dtype=dtype) for n in (t, length, length))
            bias = torch.randn(b, t, length, heads, generator=gen, dtype=dtype).permute(0, 3, 1, 2)
            count = torch.randint(2, length + 1, (b, t), generator=gen)  # two keys or more: the bias matters
            keep = (torch.arange(length)[None, None, :] < count[:, :, None])[:, None]
            want = attn.core(q, k, v, keep, bias=bias)
            got = decode_attention.attend(q, k, v, count, heads, bias=bias, scale=attn.scale)
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
            shared = bias[:1].expand(b, -1, -1, -1)
            torch.testing.assert_close(decode_attention.attend(q, k, v, count, heads, bias=shared, scale=attn.scale),
                                       attn.core(q, k, v, keep, bias=bias[:1]), rtol=tol, atol=tol)
            plain = decode_attention.attend(q, k, v, count, heads, scale=attn.scale)
            assert not torch.allclose(plain, want)
    with pytest.raises(RuntimeError, match="bias"):
        decode_attention.attend(q, k, v, count, heads, bias=bias[:, :, :, :-1])


@pytest.mark.parametrize("capability", ["AVX2", "DEFAULT"])
def test_decode_attention_kernel_for_other_cpus(capability):
    """The kernel as installed for an AVX2-only CPU (which this one can run) and with ATen's portable
    vectors (CPUs without AVX2 or another architecture), each in its own process (a process registers
    the operator once): the masked softmax's results, as above."""
    import subprocess
    import sys

    script = f"""
import torch
from aggdec.model import decode_attention
from aggdec.model.transformer import MultiheadAttention
decode_attention.load_library("{capability}")
gen = torch.Generator().manual_seed(1)
for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
    for b, t, length, dim, heads in ((1, 1, 5, 16, 4), (5, 1, 37, 32, 2), (3, 4, 9, 64, 4), (2, 3, 20, 24, 3)):
        attn = MultiheadAttention(dim, heads, 0.0).eval()
        q, k, v = (torch.randn(b, n, dim, generator=gen, dtype=dtype) for n in (t, length, length))
        count = torch.randint(1, length + 1, (b, t), generator=gen)
        keep = (torch.arange(length)[None, None, :] < count[:, :, None])[:, None]
        with torch.no_grad():
            torch.testing.assert_close(decode_attention.attend(q, k, v, count, heads),
                                       attn.core(q, k, v, keep), rtol=tol, atol=tol)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_the_loop_loads_the_attention_kernel_when_built(monkeypatch):
    """The loop loads the kernel when it is built, not in a call that the draft budget times."""
    from aggdec.model import decode_attention

    model = tiny_model("prenorm-learned-separate", seed=1, vocab=9)
    built = []
    monkeypatch.setattr(decode_attention, "_loaded", None)
    monkeypatch.setattr(decode_attention, "load_library", built.append)
    SlotLoop(model, InputCopy())
    assert built == [torch.backends.cpu.get_cpu_capability()]


def test_no_compiled_step_where_atens_isa_is_lowered():
    """Under ATEN_CPU_CAPABILITY=avx2 on a CPU with AVX-512, where a compiled step decodes wrongly
    (`compiled_step.lowered_isa`), `compile=True` gives one warning and eager steps, greedy's output."""
    import os
    import subprocess
    import sys

    if not torch.cpu.get_capabilities().get("avx512_bw"):
        pytest.skip("this CPU has no AVX-512 for ATEN_CPU_CAPABILITY=avx2 to lower")
    script = """
import random, warnings
from test_slot_loop import _requests, _run
from tiny_models import naive_greedy, tiny_model
from aggdec.decoding.slot_loop import SlotLoop
model = tiny_model("prenorm-learned-separate", seed=2, vocab=9)
reqs = _requests(random.Random(5), 6, model.cfg.src_vocab, model.cfg.eos, repeat=True)
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    loop = SlotLoop(model, max_batch_size=4, compile=True)
assert loop.compiled is None and len([w for w in said if "lowers ATen to AVX2" in str(w.message)]) == 1
assert {i: h.tokens for i, h in _run(loop, reqs).items()} == {r.index: naive_greedy(model, r.src, r.max_len) for r in reqs}
print("ok")
"""
    tests = os.path.dirname(__file__)
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", PYTHONPATH=os.pathsep.join([tests, os.path.dirname(tests)]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


@compiles
@pytest.mark.parametrize("kind", ["prenorm-learned-separate", pytest.param("t5-gated-like", marks=pytest.mark.slow)])
def test_compiled_step_with_the_attention_kernel_equals_greedy(kind):
    """A compiled step calls the attention kernel (T5: with its relative position bias): naive greedy's
    output, with the slots refilled and the tail narrowed (one program for all of it)."""
    model = tiny_model(kind, seed=2, vocab=9)
    reqs = _requests(random.Random(5), 48, model.cfg.src_vocab, model.cfg.eos, repeat=True)
    ref = {r.index: naive_greedy(model, r.src, r.max_len) for r in reqs}
    loop = SlotLoop(model, NoDraft(), max_batch_size=16, compile=True)
    assert {i: h.tokens for i, h in _run(loop, reqs).items()} == ref
    _assert_compiled(loop, 1)


def _assert_compiled(loop: SlotLoop, programs: int) -> None:
    """`loop` still compiles (no failed compile made it eager) and ran `programs` programs."""
    assert loop.compile and loop.compiled is not None and len(loop.compiled.programs) == programs, loop.compiled


@compiles
@pytest.mark.slow  # the default suite's test_step_store checks a same-shape model's own program across processes
def test_compiled_steps_keep_their_own_weights():
    """fp32 models of the same shapes (their weights frozen into each program): two loops compiled in one
    process decode as their own model does eagerly, run after run, each from a package of its own."""
    models = [tiny_model("prenorm-learned-separate", seed=seed, vocab=9).float() for seed in (5, 6)]
    reqs = _requests(random.Random(7), 12, 9, models[0].cfg.eos, repeat=True)
    compiled = [SlotLoop(m, max_batch_size=4, compile=True) for m in models]
    eager = [{i: h.tokens for i, h in _run(SlotLoop(m, max_batch_size=4), reqs).items()} for m in models]
    assert eager[0] != eager[1]
    for _ in range(2):
        for loop, ref in zip(compiled, eager):
            assert {i: h.tokens for i, h in _run(loop, reqs).items()} == ref
    first, second = (loop.compiled for loop in compiled)
    assert first.keys != second.keys and first.built == second.built == 1


@compiles
def test_compiled_step_equals_greedy():
    """A compiled step (CPU, symbolic shapes: one program for every span, source width, draft width and
    narrowed slot count) gives naive greedy's output across runs that reuse the loop, reached through the
    public option of greedy and of IAD (batch size 3: 4 slots narrowing to 2), its draft budget not timing
    the calls that built or loaded a program. The loop of one option set takes each call's compile choice
    on its own slots: eager, then compiled again, with no new allocation nor program."""
    from aggdec.decoding.compile_choice import backend
    from aggdec.decoding.method_options import decode_options
    from aggdec.decoding.methods import DraftContext, get_method
    from aggdec.model.projection import OutputProjection

    model = tiny_model("prenorm-learned-separate", seed=3, vocab=9)
    rng = random.Random(4)
    reqs = _requests(rng, 10, model.cfg.src_vocab, model.cfg.eos, repeat=True)
    ref = {r.index: naive_greedy(model, r.src, r.max_len) for r in reqs}
    opts = decode_options("greedy", compile=True, max_batch_size=4)
    context = DraftContext(model=model, projection=OutputProjection(model.output_weight, certify=False), bf16=False,
                           load=None)
    method = get_method("greedy")
    loop = greedy = method.loop(opts, context, method.drafter(opts, context))
    for run in (reqs[:2], reqs, reqs[3:]):  # 2 slots, then 4 narrowing to 2
        assert {i: h.tokens for i, h in _run(loop, run).items()} == {r.index: ref[r.index] for r in run}
    _assert_compiled(loop, 1)
    assert loop.compiled.built + loop.compiled.loaded == 1
    with pytest.raises(ValueError, match="compile: takes the fp32 verifier"):
        decode_options("greedy", compile=True, precision="int8")
    iad = decode_options("iad", compile=True, max_batch_size=3)
    loop = get_method("iad").loop(iad, context, get_method("iad").drafter(iad, context))
    heard, record = [], loop.budget.record
    loop.budget.record = lambda *a, **k: (heard.append(a[0]), record(*a, **k))
    assert {i: h.tokens for i, h in _run(loop, reqs).items()} == ref
    # the draft budget does not hear the calls that built or loaded a program (seconds, once: a first
    # trial of drafting that paid for it lost, and greedy stayed chosen)
    programs = len(loop.compiled.programs)
    assert programs >= 1 and len(heard) == loop.counters.calls - programs
    _assert_compiled(loop, programs)
    # options used in turn keep their compiled steps and their buffers: back to greedy's, eagerly then
    # compiled, nothing is built, loaded or allocated
    allocations = greedy.counters.allocations
    for compile in (False, True):
        assert method.loop(opts, context, method.drafter(opts, context), compile=compile) is greedy
        assert backend(greedy) == ("compiled" if compile else "eager")
        assert {i: h.tokens for i, h in _run(greedy, reqs).items()} == ref
    assert greedy.compiled.built + greedy.compiled.loaded == 1 and greedy.counters.allocations == allocations
    assert list(context.slot_loops) == [(iad, 0), (opts, 0)]


@compiles
def test_the_registry_puts_every_acceptance_rule_on_compiled_slots():
    """`compile = true` takes gad, gad++ (with a minimum block) and blockwise top-k to the slot loop with
    the options' own acceptance rule, on a double-token verifier too."""
    from aggdec.decoding.method_options import decode_options
    from aggdec.decoding.methods import DraftContext, get_method
    from aggdec.model.projection import OutputProjection

    def context(model, head):
        return DraftContext(model=model, projection=OutputProjection(model.output_weight, certify=False),
                            bf16=False, load=lambda path, bf16: head)

    model = tiny_model("prenorm-learned-separate", seed=3, vocab=9)
    for method, kind, extra in (("gad", "gad", {}), ("gad++", "gad", dict(top_beta=2, min_block=1)),
                                ("blockwise", "blockwise", dict(top_k_accept=3))):
        drafter = _head_drafter(kind, model, 3)
        ctx = context(model, drafter.head if kind == "gad" else drafter.heads)
        opts = decode_options(method, compile=True, drafter="d", block_size=3, **extra)
        loop = get_method(method).loop(opts, ctx, get_method(method).drafter(opts, ctx))
        assert isinstance(loop, SlotLoop) and loop.compiled is not None
        assert loop.acceptance.describe() == opts.acceptance().describe()
    pairs = tiny_model("double-token", seed=1, vocab=9)
    opts = decode_options("gad++", compile=True, drafter="d", block_size=3)
    ctx = context(pairs, _head_drafter("gad", pairs, 3).head)
    loop = get_method("gad++").loop(opts, ctx, get_method("gad++").drafter(opts, ctx))
    assert isinstance(loop, SlotLoop) and loop.compiled is not None and loop.stride == 2


@compiles
@pytest.mark.slow  # compiles of greedy and drafting steps: about a minute each on 2 busy cores
def test_compiled_double_token_steps_equal_greedy():
    """A compiled step on a double-token verifier (greedy, IAD by whole pairs) gives the model's greedy
    output, run after run; in float64 and in fp32 (whose greedy step takes TorchInductor's C++ GEMM
    template, its drafting step ATen's products)."""
    for model in (tiny_model("double-token", seed=1, vocab=9), tiny_model("double-token", seed=1, vocab=9).float()):
        reqs = _requests(random.Random(4), 10, model.cfg.src_vocab, model.cfg.eos, repeat=True)
        ref = {i: h.tokens for i, h in _decode(model, NoDraft(), reqs, max_batch_size=3).items()}
        for drafter in (NoDraft(), InputCopy(max_draft=4)):
            loop = SlotLoop(model, drafter, max_batch_size=4, compile=True)
            for _ in range(2):
                assert {i: h.tokens for i, h in _run(loop, reqs).items()} == ref
            _assert_compiled(loop, 1)


@compiles
@pytest.mark.slow  # a compile of a drafting step: about 2 minutes on 2 busy cores
def test_compiled_gad_plus_equals_the_eager_loop():
    """`compile = true` with method gad++ (top-beta/tau and a minimum block, at a fixed draft length)
    runs on compiled slots and gives the eager step's output."""
    from aggdec.decoding.method_options import decode_options
    from aggdec.decoding.methods import DraftContext, get_method
    from aggdec.model.projection import OutputProjection

    model = tiny_model("prenorm-learned-separate", seed=3, vocab=9)
    reqs = _requests(random.Random(4), 10, model.cfg.src_vocab, model.cfg.eos, repeat=True)
    torch.manual_seed(0)
    head = _head_drafter("gad", model, 4).head
    context = DraftContext(model=model, projection=OutputProjection(model.output_weight, certify=False), bf16=False,
                           load=lambda path, bf16: head)
    opts = decode_options("gad++", compile=True, max_batch_size=2, drafter="head", block_size=4, draft_length="max",
                          top_beta=3, tau=1.0, min_block=1)
    method = get_method("gad++")
    loop = method.loop(opts, context, method.drafter(opts, context))
    got = _run(loop, reqs)
    _assert_compiled(loop, 1)  # (a row's first call drafts none of the width its step takes)
    ref = _decode(model, method.drafter(opts, context), reqs, acceptance=opts.acceptance(), max_batch_size=2)
    assert {i: h.tokens for i, h in got.items()} == {i: h.tokens for i, h in ref.items()}


CHECKED = {"greedy": lambda m: NoDraft(), "iad": lambda m: InputCopy(max_draft=4, substitution=True, nearest_match=True),
           "iad-adaptive": lambda m: InputCopy(max_draft=4, adaptive=True, min_draft=1, skip_prefix=True),
           "gad": lambda m: _head_drafter("gad", m, 3), "gad-vocab": lambda m: _head_drafter("gad", m, 3, vocab=4),
           "blockwise": lambda m: _head_drafter("blockwise", m, 3),
           "gad++ beta 1": lambda m: _head_drafter("gad", m, 3)}


@pytest.mark.parametrize("method", CHECKED)
def test_every_slot_method_keeps_capture_discipline(method):
    """Every method of the captured path runs its steps as a replayed CUDA graph would (`graphs="check"`:
    no host read inside a step, no state left in a tensor the step allocated, outputs read from
    buffers of their own): naive greedy's output, with refills, a random draft budget (widths 0
    included) and the tail narrowed, run after run. GAD++ reads the full logits (top-1 at beta 1)."""
    model = tiny_model("prenorm-learned-separate", seed=4, vocab=9)
    reqs = _requests(random.Random(6), 20, model.cfg.src_vocab, model.cfg.eos, repeat=True)
    ref = {r.index: naive_greedy(model, r.src, r.max_len) for r in reqs}
    torch.manual_seed(6)
    drafter = CHECKED[method](model)
    acceptance = TopKTolerance(1, 2.0) if method.startswith("gad++") else None
    loop = SlotLoop(model, drafter, acceptance, max_batch_size=4, graphs="check",
                    budget=RandomBudget(6, drafter.max_draft or 6) if drafter.max_draft != 0 else None)
    for _ in range(2):
        assert {i: h.tokens for i, h in _run(loop, reqs).items()} == ref


def test_the_capture_plan_is_bounded_and_largest_first():
    """Slot counts halving down to `fewest`, widths 0, the longest draft and the powers of two below it;
    the largest step first, each once; no span or source width (a captured step reads the whole cache)."""
    plan = capture_plan(128, 64, fewest=32)
    assert len(plan) == len(set(plan)) == 3 * 8 and plan == sorted(plan, reverse=True)
    assert plan[0] == (128, 64)
    assert {k[0] for k in plan} == {128, 64, 32} and {k[1] for k in plan} == {0, 1, 2, 4, 8, 16, 32, 64}
    assert capture_plan(4, 3, fewest=2) == [(n, w) for n in (4, 2) for w in (3, 2, 1, 0)]
    assert capture_plan(4, 3, fewest=32) == [(4, w) for w in (3, 2, 1, 0)]  # fewer slots than the floor: all


def test_capture_discipline_finds_host_reads_and_state_allocated_in_a_step():
    """The check backend refuses a drafter that reads the host inside the step and one that keeps its
    state in a tensor allocated by the step (a replay would rewrite it)."""
    from aggdec.decoding.capture_check import CaptureError

    class Reads(InputCopy):
        def propose(self, state, width=None):
            int(state.out_len.max())
            return super().propose(state, width)

    class Keeps(InputCopy):
        def observe(self, state, draft, accepted, verified):
            self.rows.resume = accepted + 1

    model = tiny_model(seed=1, vocab=9)
    reqs = _requests(random.Random(1), 4, model.cfg.src_vocab, model.cfg.eos)
    with pytest.raises(CaptureError, match="reads a tensor on the host"):
        _run(SlotLoop(model, Reads(max_draft=3), max_batch_size=2, graphs="check"), reqs)
    with pytest.raises(CaptureError, match="rows._tensors\\['resume'\\]"):
        _run(SlotLoop(model, Keeps(max_draft=3, substitution=True), max_batch_size=2, graphs="check"), reqs)
    assert _run(SlotLoop(model, Keeps(max_draft=3, substitution=True), max_batch_size=2), reqs)  # eager runs it


@pytest.mark.parametrize("drafter, most", [(NoDraft, 8), (InputCopy, 16)], ids=["greedy", "iad"])
def test_a_captured_loop_plans_few_steps(drafter, most):
    """A captured loop over 64 slots plans (slots, width) steps only, the slot counts it narrows to
    (64, 32: `GRAPH_MIN_SLOTS`) times its widths (IAD's 64-token drafts: 0 and the powers of two to
    64): at most 16 for IAD, 8 for greedy. Checked as a captured run takes them (`graphs="check"`),
    every step it runs is in the plan, runs of 100 and 3 requests run on 64 and 32 slots (the
    tail narrowed to 32), and the outputs are naive greedy's."""
    model = tiny_model("prenorm-learned-separate", seed=1, vocab=9)
    reqs = _requests(random.Random(8), 100, model.cfg.src_vocab, model.cfg.eos, repeat=True)
    ref = {r.index: naive_greedy(model, r.src, r.max_len) for r in reqs}
    loop = SlotLoop(model, drafter(), max_batch_size=64, graphs="check")
    keys = []
    step = loop.step
    loop.step = lambda width, *rest: (keys.append((loop.state.batch_size, width)), step(width, *rest))[1]
    assert {i: h.tokens for i, h in _run(loop, reqs).items()} == ref
    assert len(loop._plan) <= most and set(keys) <= set(loop._plan) and {n for n, _ in keys} == {64, 32}
    keys.clear()
    assert {i: h.tokens for i, h in _run(loop, reqs[:3]).items()} == {r.index: ref[r.index] for r in reqs[:3]}
    assert {n for n, _ in keys} == {32} and loop.counters.allocations == 1


@pytest.mark.parametrize("bs", [1, 64])
def test_a_bf16_verifier_decides_alike_at_every_batch_shape(bs):
    """A bf16 verifier's fixed-shape step (`graphs="check"`), which reads the whole cache, decides as eager
    greedy: IAD there, verifying (slots, width + 1) positions a call, is eager greedy's output at one
    position a row, at 1 and 64 slots. Both take the top-1 from fp32 logits (the loop's `OutputProjection`:
    bf16 logits round near ties into exact ones), and attention over an fp32 slot cache reads each row's
    own keys (masked bf16 products over the whole cache summed in another order than over the exact span,
    and a row differed)."""
    from aggdec.model.precision import with_precision

    model = with_precision(tiny_model("postnorm-sinusoidal-shared", seed=3, vocab=200, d_model=32), "bf16")
    reqs = _requests(random.Random(9), 64, 200, model.cfg.eos, max_src=20)
    greedy = {i: h.tokens for i, h in _run(SlotLoop(model, NoDraft(), max_batch_size=1), reqs).items()}
    loop = SlotLoop(model, InputCopy(max_draft=8), max_batch_size=bs, graphs="check")
    assert {i: h.tokens for i, h in _run(loop, reqs).items()} == greedy
    hidden = torch.randn(5, 32, dtype=torch.bfloat16)
    logits = loop.projection.logits(hidden)  # what the fixed step's acceptance reads
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden.float() @ model.output_weight.float().T, rtol=1e-6, atol=1e-6)


def test_capture_discipline_covers_admission_and_retirement(monkeypatch):
    """In check mode, admission and retirement run under a replay's rules too, outside the loop's one
    packed copy of a refill batch and its one read of the retired rows: a drafter's `admit` that reads
    the host, copies host data of its own, or keeps its rows in new tensors (which captured steps would
    not see) is refused, as is a `propose` that builds a tensor from host data within the step, and a host
    read added to retirement; eagerly all of them decode."""
    from aggdec.decoding.capture_check import CaptureError

    class Reads(InputCopy):
        def admit(self, state, slots):
            super().admit(state, slots)
            state.src_len[slots].max().item()

    class Copies(InputCopy):
        def admit(self, state, slots):
            super().admit(state, slots)
            self.rows.start[slots] = torch.tensor([-1] * slots.numel())

    class Keeps(InputCopy):
        def admit(self, state, slots):
            super().admit(state, slots)
            self.rows.resume = self.rows.resume.clone()

    class Builds(InputCopy):  # within the step: a captured graph would keep the data of its capture
        def propose(self, state, width):
            draft = super().propose(state, width)
            return dataclasses.replace(draft, num_draft=draft.num_draft + torch.tensor([0] * state.batch_size))

    model = tiny_model(seed=1, vocab=9)
    reqs = _requests(random.Random(2), 6, model.cfg.src_vocab, model.cfg.eos)
    ref = {r.index: naive_greedy(model, r.src, r.max_len) for r in reqs}
    for drafter, error in ((Reads, "reads a tensor on the host"), (Copies, "builds a tensor from host data"),
                           (Keeps, "rows._tensors\\['resume'\\]"), (Builds, "builds a tensor from host data")):
        with pytest.raises(CaptureError, match=error):
            _run(SlotLoop(model, drafter(max_draft=3), max_batch_size=2, graphs="check"), reqs)
        eager = SlotLoop(model, drafter(max_draft=3), max_batch_size=2)
        assert {i: h.tokens for i, h in _run(eager, reqs).items()} == ref
    assert {i: h.tokens for i, h in _run(SlotLoop(model, InputCopy(max_draft=3), max_batch_size=2, graphs="check"),
                                         reqs).items()} == ref
    retired = SlotLoop._retired
    monkeypatch.setattr(SlotLoop, "_retired", lambda self, *a: (self.iterations.sum().item(), retired(self, *a))[1])
    with pytest.raises(CaptureError, match="reads a tensor on the host"):
        _run(SlotLoop(model, NoDraft(), max_batch_size=2, graphs="check"), reqs)


def test_a_loop_refuses_int8_on_cuda(monkeypatch):
    """int8 decodes on CPUs only: the guard refuses a CUDA device in one line and passes the CPU, and a
    slot loop given an int8 verifier asks it for its own device (a CUDA device cannot be faked here;
    tests/test_cuda.py refuses int8 there through the API)."""
    from aggdec.decoding import slot_loop
    from aggdec.model.precision import refuse_int8, with_precision

    with pytest.raises(ValueError, match=r"^precision: int8 decodes on CPUs only [^\n]*$"):
        refuse_int8(torch.device("cuda"))
    refuse_int8(torch.device("cpu"))
    asked = []
    monkeypatch.setattr(slot_loop, "refuse_int8", asked.append)
    model = tiny_model(seed=1, vocab=9)
    SlotLoop(model)
    assert asked == []
    SlotLoop(with_precision(model, "int8"))
    assert asked == [torch.device("cpu")]


@pytest.mark.parametrize("kind", ["prenorm-learned-separate", "t5-gated-like", "double-token"])
def test_masked_attention_on_the_slot_grid_equals_the_kernel(kind, monkeypatch):
    """Without the CPU kernel (a GPU's path; a CPU where it did not load), a step takes every position of
    every slot and attends by masked products on the slot grid: the kernel's tokens and statistics
    (float64; T5's bias, a double-token model's pairs; IAD's drafts, refills and the narrowed tail),
    eagerly and in check mode."""
    from aggdec.model import decode_attention

    model = tiny_model(kind, seed=4, vocab=9)
    reqs = _requests(random.Random(6), 10, model.cfg.src_vocab, model.cfg.eos, repeat=True)
    drafter = (lambda: NoDraft()) if kind == "double-token" else (lambda: InputCopy(max_draft=4))

    def decoded(**kw):
        return {i: (h.tokens, h.stats.iterations, h.stats.accepted)
                for i, h in _run(SlotLoop(model, drafter(), max_batch_size=4, **kw), reqs).items()}

    kernel = decoded()
    monkeypatch.setattr(decode_attention, "_loaded", False)
    loop = SlotLoop(model, drafter(), max_batch_size=4)
    assert not loop._live_tokens
    assert decoded() == kernel == decoded(graphs="check")
