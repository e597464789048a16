"""The draft -> verify loop is lossless: any drafter with exact-match acceptance gives greedy's output,
for any batch size, token budget, draft cap and refill order (float64 random models)."""

import copy
import random

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tiny_models import naive_greedy, tiny_model

from aggdec.decoding import scheduler as loop_module
from aggdec.decoding.budget import DraftBudget
from aggdec.decoding.drafters import NoDraft, RowState
from aggdec.decoding.gad_head import DraftHeadDrafter
from aggdec.decoding.iad import InputCopy
from aggdec.decoding.metadata import DraftBatch, Request
from aggdec.decoding.slot_loop import SlotLoop
from aggdec.model import linear
from aggdec.model.config import ModelConfig
from aggdec.model.draft_head import DraftHead, DraftHeadConfig
from aggdec.model.transformer import Transformer


class GuideDrafter(NoDraft):
    """Test drafter: proposes the next `k` tokens of a per-request guide (a corrupted greedy output), so
    long drafts are accepted, partially accepted and rejected; exercises commit, rollback and eos. Its
    drafts are a fixed-shape program from per-row tensors (no host reads): every step runs it, eager or fixed."""

    name = "guide"

    def __init__(self, guides: dict[int, list[int]], k: int):
        self.guides, self.k, self.max_draft = guides, k, k
        self.longest = max(map(len, guides.values()), default=0) + 1
        self.rows = RowState()
        # by request index, on the device (the CPU here): admission reads them through `DecodeState.index`
        rows = max(guides, default=0) + 1
        self.table = torch.zeros(rows, self.longest, dtype=torch.long)
        self.lengths = torch.zeros(rows, dtype=torch.long)
        for i, g in guides.items():
            self.table[i, : len(g)], self.lengths[i] = torch.tensor(g), len(g)

    def admit(self, state, slots):
        self.rows.admit(state, slots, guide=(state.pad, self.longest), length=0)
        index = state.index[slots]
        self.rows.guide[slots] = self.table[index]
        self.rows.length[slots] = self.lengths[index]

    def propose(self, state, width=None):
        at = state.out_len[:, None] - 1 + torch.arange(width or self.k)[None]  # the guide at out_len - 1 on
        return DraftBatch(tokens=self.rows.guide.gather(1, at.clamp(max=self.longest - 1)),
                          num_draft=(self.rows.length - state.out_len + 1).clamp(0, self.k))


class RandomBudget(DraftBudget):
    """Draft lengths drawn at random (0 included): outputs must not depend on them."""

    def __init__(self, seed: int, max_length: int):
        super().__init__(max_length)
        self.rng = random.Random(seed)

    def next_length(self, rows, limit):
        return self.rng.randint(0, limit)


def _requests(rng, n, vocab, eos, max_src=14, repeat=False):
    reqs = []
    for i in range(n):
        length = rng.choice([0, 1, rng.randint(1, max_src), max_src * 3])  # empty, tiny, normal, long
        alphabet = [4, 5] if repeat and rng.random() < 0.5 else list(range(4, vocab))
        src = [rng.choice(alphabet) for _ in range(length)] + [eos]
        reqs.append(Request(index=i, src=src, max_len=min(60, rng.randint(1, 2 * length + 5))))
    return reqs


def _decode(model, drafter, reqs, **kw):
    hyps = list(SlotLoop(model, drafter, **kw).run(reqs))
    assert sorted(h.index for h in hyps) == sorted(r.index for r in reqs), "every request yields exactly one output"
    return {h.index: h for h in hyps}


@pytest.mark.parametrize("kind", ["postnorm-sinusoidal-shared", "prenorm-learned-separate"])
def test_greedy_loop_equals_naive_recompute(kind):
    model = tiny_model(kind)
    reqs = _requests(random.Random(0), 12, model.cfg.src_vocab, model.cfg.eos)
    ref = {r.index: naive_greedy(model, r.src, r.max_len) for r in reqs}
    for bs in (1, 5):
        got = _decode(model, NoDraft(), reqs, max_batch_size=bs)
        assert {i: h.tokens for i, h in got.items()} == ref
        assert all(h.stats.iterations == len(h.tokens) + 1 for h in got.values()), "greedy: one call per token"


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10**6), kind=st.sampled_from(["marian-like", "bart-like", "t5-like", "t5-gated-like"]),
       bs=st.integers(1, 6),
       forced=st.integers(0, 2), budget=st.sampled_from([None, "random"]))
def test_imported_layouts_and_prompts_are_lossless(seed, kind, bs, forced, budget):
    """Hugging Face layouts (position offsets, Marian's sinusoids, silu, an output bias; T5's relative
    positions, RMS norms, gated FFN, head size, output scale) with a start token and forced first tokens: the loop equals naive recomputation, and IAD and the draft head
    leave it unchanged."""
    model = tiny_model(kind, seed=seed % 7)
    rng = random.Random(seed)
    prompt = tuple(rng.randint(3, model.cfg.tgt_vocab - 1) for _ in range(1 + forced))
    reqs = [r for r in _requests(rng, rng.randint(1, 8), model.cfg.src_vocab, model.cfg.eos) if r.max_len > forced]
    ref = {r.index: naive_greedy(model, r.src, r.max_len, prompt) for r in reqs}
    assert all(ref[r.index][:forced] == list(prompt[1:]) for r in reqs)
    torch.manual_seed(seed)
    head = DraftHead(DraftHeadConfig(d_model=16, heads=2, kv_dim=model.cfg.inner_dim(2), ffn=24, layers=1,
                                     block_size=3)).double().eval()
    budgets = {None: None, "random": RandomBudget(seed, 4)}
    for drafter in (NoDraft(), InputCopy(max_draft=4), DraftHeadDrafter(model, head)):
        got = _decode(model, drafter, reqs, max_batch_size=bs, prompt=prompt, budget=budgets[budget])
        assert {i: h.tokens for i, h in got.items()} == ref, type(drafter).__name__


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), bs=st.integers(1, 8), cap=st.one_of(st.none(), st.integers(1, 6)),
       adaptive=st.booleans(), refill=st.booleans(), max_tokens=st.one_of(st.none(), st.integers(1, 60)),
       repeat=st.booleans(), substitution=st.booleans(), nearest_match=st.booleans(), skip_prefix=st.booleans(),
       encode_batch=st.integers(0, 6), budget=st.sampled_from([None, "random", "measured"]))
def test_iad_equals_greedy(seed, bs, cap, adaptive, refill, max_tokens, repeat, substitution, nearest_match,
                           skip_prefix, encode_batch, budget):
    model = tiny_model("shallow-decoder-tied-output", vocab=9)
    rng = random.Random(seed)
    reqs = _requests(rng, rng.randint(1, 10), model.cfg.src_vocab, model.cfg.eos, repeat=repeat)
    rng.shuffle(reqs)  # refill order
    greedy = _decode(model, NoDraft(), reqs, max_batch_size=3)
    fallbacks = dict(substitution=substitution, nearest_match=nearest_match, skip_prefix=skip_prefix)
    drafter = (InputCopy(max_draft=cap or 4, adaptive=True, min_draft=1, **fallbacks) if adaptive
               else InputCopy(max_draft=cap, **fallbacks))
    budgets = {None: None, "random": RandomBudget(seed, cap or 6), "measured": DraftBudget(cap or 6, block=2)}
    iad = _decode(model, drafter, reqs, max_batch_size=bs, refill=refill, max_tokens=max_tokens,
                  encode_batch=encode_batch, budget=budgets[budget])
    assert {i: h.tokens for i, h in iad.items()} == {i: h.tokens for i, h in greedy.items()}
    for h in iad.values():
        assert h.stats.iterations == len(h.stats.accepted_per_iter)
        assert h.stats.accepted == sum(h.stats.accepted_per_iter) <= h.stats.drafted
        assert 0 <= h.stats.iterations + h.stats.accepted - (len(h.tokens) + 1) <= 1



def test_refills_are_encoded_ahead_in_batches(monkeypatch):
    """Freed slots take sentences encoded ahead: every request is encoded once, in fewer, larger
    encoder calls, and the outputs do not change."""
    model = tiny_model("shallow-decoder-tied-output", vocab=9)
    reqs = _requests(random.Random(5), 40, model.cfg.src_vocab, model.cfg.eos)
    sizes: list[int] = []
    encode = type(model).encode
    monkeypatch.setattr(type(model), "encode", lambda self, src: sizes.append(src.shape[0]) or encode(self, src))
    outs, calls = [], []
    for ahead in (0, 8):
        sizes.clear()
        loop = SlotLoop(model, NoDraft(), max_batch_size=4, encode_batch=ahead)
        outs.append({h.index: h.tokens for h in loop.run(reqs)})
        assert sum(sizes) == loop.counters.encoded_rows == len(reqs)
        calls.append(len(sizes))
    assert outs[0] == outs[1]
    assert calls[1] < calls[0] / 2, calls


def test_small_batches_encode_refills_ahead_within_a_token_limit(monkeypatch):
    """By default even batch 1 encodes ENCODE_AHEAD pending sentences together, fewer where their
    padded source tokens would pass ENCODE_AHEAD_TOKENS; outputs are those of encoding one by one."""
    model = tiny_model("shallow-decoder-tied-output", vocab=9)
    reqs = _requests(random.Random(7), 90, model.cfg.src_vocab, model.cfg.eos)
    shapes: list[tuple[int, int]] = []
    encode = type(model).encode
    monkeypatch.setattr(type(model), "encode", lambda self, src: shapes.append(tuple(src.shape)) or encode(self, src))
    monkeypatch.setattr(loop_module, "ENCODE_AHEAD_TOKENS", 120)
    alone = {h.index: h.tokens for h in SlotLoop(model, NoDraft(), max_batch_size=1, encode_batch=1).run(reqs)}
    shapes.clear()
    loop = SlotLoop(model, NoDraft(), max_batch_size=1)
    assert {h.index: h.tokens for h in loop.run(reqs)} == alone
    assert sum(b for b, _ in shapes) == loop.counters.encoded_rows == len(reqs)
    assert all(b == 1 or b <= loop_module.ENCODE_AHEAD and b * width <= 120 for b, width in shapes), shapes
    assert max(b for b, _ in shapes) == loop_module.ENCODE_AHEAD  # short sentences fill a whole batch
    assert len(shapes) < len(reqs) / 4, shapes


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), bs=st.integers(1, 6), k=st.integers(1, 12), corrupt=st.floats(0, 0.5))
@example(seed=0, bs=1, k=3, corrupt=0.0)  # drafts longer than the source: verified whole (`Drafter.source_bound`)
def test_guided_drafts_accept_and_roll_back_losslessly(seed, bs, k, corrupt):
    model = tiny_model("prenorm-learned-separate")
    rng = random.Random(seed)
    reqs = _requests(rng, rng.randint(1, 8), model.cfg.src_vocab, model.cfg.eos)
    greedy = _decode(model, NoDraft(), reqs, max_batch_size=4)
    guides = {}
    for i, h in greedy.items():
        g = h.tokens + [model.cfg.eos] + [rng.randint(0, model.cfg.tgt_vocab - 1) for _ in range(3)]
        guides[i] = [t if rng.random() >= corrupt else rng.randint(0, model.cfg.tgt_vocab - 1) for t in g]
    got = _decode(model, GuideDrafter(guides, k), reqs, max_batch_size=bs)
    assert {i: h.tokens for i, h in got.items()} == {i: h.tokens for i, h in greedy.items()}
    for h in got.values():  # drafts accepted after an accepted eos are not counted
        assert 0 <= h.stats.iterations + h.stats.accepted - (len(h.tokens) + 1) <= 1
    if corrupt == 0:  # perfect drafts: each call accepts min(k, rest) tokens
        for i, h in got.items():
            need = len(h.tokens) + 1
            assert h.stats.iterations == -(-need // (k + 1))


def _reference_match(x: list[int], o: list[int], anchor: int = -1) -> int:
    """Algorithm 1's re-alignment by brute force: smallest q with a unique occurrence of o[-q:] in x.
    With an anchor >= 0 and no unique occurrence: the end of the longest repeated suffix's occurrence
    nearest the anchor (the later one on a tie)."""
    repeated: list[int] = []
    for q in range(1, len(o) + 1):
        suffix = o[-q:]
        ends = [i for i in range(q - 1, len(x)) if x[i - q + 1 : i + 1] == suffix]
        if len(ends) == 1:
            return ends[0]
        if not ends:
            break
        repeated = ends
    if anchor >= 0 and repeated:
        return min(repeated, key=lambda i: (abs(i - anchor), -i))
    return -1


@settings(max_examples=200, deadline=None)
@given(src=st.lists(st.integers(4, 7), max_size=12), outs=st.lists(st.lists(st.integers(4, 7), max_size=10), min_size=1, max_size=4),
       anchor_seed=st.integers(0, 10**6))
def test_input_copy_match_is_algorithm_1(src, outs, anchor_seed):
    """The fixed-shape suffix match equals the brute-force definition, row by row (also with anchors), and
    the host match equals it at every depth."""
    from tiny_models import tiny_model as _m

    from aggdec.decoding.state import DecodeState

    model = _m()
    eos, pad = model.cfg.eos, model.cfg.pad
    s = src + [eos]
    bsz = len(outs)
    width = max(len(o) for o in outs) + 1
    out = torch.full((bsz, width), pad)
    out[:, 0] = eos
    for b, o in enumerate(outs):
        out[b, 1 : 1 + len(o)] = torch.tensor(o, dtype=torch.long)
    state = DecodeState(src=torch.tensor([s] * bsz), src_len=torch.full((bsz,), len(s)), out=out,
                        out_len=torch.tensor([len(o) + 1 for o in outs]), max_len=torch.full((bsz,), 99),
                        cache=None, requests=[], pad=pad, eos=eos)
    BOS = -1
    want = [_reference_match([BOS] + s, [BOS] + o) for o in outs]
    assert InputCopy().match(state, width + 1).tolist() == want  # a depth that covers the whole output
    rng = random.Random(anchor_seed)
    anchors = torch.tensor([rng.randint(-1, len(s) + 1) for _ in outs])
    got = InputCopy().match(state, width + 1, anchors).tolist()
    assert got == [_reference_match([BOS] + s, [BOS] + o, a) for o, a in zip(outs, anchors.tolist())]
    # suffixes longer than the depth count as no match
    short = InputCopy().match(state, 2).tolist()
    assert all(g in (w, -1) for g, w in zip(short, want))


def test_a_model_trains_after_decoding_and_then_decodes_its_new_weights():
    """Decoding runs under inference mode. What it leaves on the model (fused q/k/v weights, packed
    weights) must not reach autograd, and must follow the weights: a training step after decoding
    works, and the next decode equals that of a fresh copy of the trained model."""
    torch.manual_seed(5)  # fp32 and wide enough that products are packed; default initialization
    model = Transformer(ModelConfig(src_vocab=32, tgt_vocab=32, d_model=256, enc_layers=1, dec_layers=1, enc_heads=4,
                                    dec_heads=4, enc_ffn=1024, dec_ffn=1024, max_source_positions=64,
                                    max_target_positions=64)).eval()
    reqs = _requests(random.Random(5), 8, model.cfg.src_vocab, model.cfg.eos)
    before = {i: h.tokens for i, h in _decode(model, NoDraft(), reqs, max_batch_size=4).items()}
    if linear.enabled():  # oneDNN in this build of PyTorch
        assert any(getattr(m, "_pack", None) is not None for m in model.modules()), "decoding packed no weight"
    model.train()
    g = torch.Generator().manual_seed(5)
    src = torch.randint(4, model.cfg.src_vocab, (3, 7), generator=g)
    prev = torch.randint(4, model.cfg.tgt_vocab, (3, 5), generator=g)
    model(src, prev).logsumexp(-1).mean().backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    model.eval()
    after = {i: h.tokens for i, h in _decode(model, NoDraft(), reqs, max_batch_size=4).items()}
    fresh = {i: h.tokens for i, h in _decode(copy.deepcopy(model), NoDraft(), reqs, max_batch_size=4).items()}
    assert after == fresh and after != before
