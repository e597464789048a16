"""Certified bf16 top-1: equal to the fp32 argmax everywhere, including near-ties and constraints."""

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from aggdec import api
from aggdec.api import Translator
from aggdec.decoding.acceptance import constrain_logits
from aggdec.model.precision import Int8Weight
from aggdec.model.projection import OutputProjection, Rules, first_argmax, top2
from aggdec.thresholds import AUTO_CERTIFIED_ROWS, TOP1_ROWS

ROOT = Path(__file__).resolve().parents[1]


class _NoRules:
    """Rules that change nothing (duck-typed `Rules`)."""

    def mask(self, z, rows=None):
        return z

    def override(self, top1):
        return top1


_no_rules = _NoRules()


def _weights(seed: int, vocab: int = 3000, dim: int = 256) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, dim, generator=g) * (0.5 + torch.rand(vocab, 1, generator=g))


def _confident_and_tied(w: torch.Tensor, n: int, seed: int, nudge: float = 1e-6) -> torch.Tensor:
    """Hidden states (n, D): half point at one vocabulary row (clear winners), half are moved so that
    two chosen logits tie up to ~`nudge` relative (the bf16 argmax is then a coin flip)."""
    g = torch.Generator().manual_seed(seed)
    v = w.shape[0]
    a, b = torch.randint(0, v, (n,), generator=g), torch.randint(0, v, (n,), generator=g)
    h = torch.randn(n, w.shape[1], generator=g) * 0.2 + w[a] * 2
    # Move the second half along (w_b - w_a) until z_a == z_b, then nudge by a tiny amount.
    half = torch.arange(n) >= n // 2
    d = w[b] - w[a]
    gap = ((h * (w[a] - w[b])).sum(1) / (d * d).sum(1).clamp(min=1e-12))
    nudge = torch.randn(n, generator=g) * nudge
    h = torch.where(half[:, None] & (a != b)[:, None], h + (gap + nudge)[:, None] * d, h)
    return h


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_certified_top1_equals_fp32_argmax(seed):
    w = _weights(seed)
    proj = OutputProjection(w, certify=True)
    h = _confident_and_tied(w, 400, seed)
    got = proj.top1(h, _no_rules)
    want = F.linear(h, w).argmax(dim=-1)
    assert torch.equal(got, want)
    # Not vacuous: clear winners are certified in bf16, ~1e-6 ties are too close to refine from the
    # candidates and are recomputed as whole fp32 rows.
    assert proj.certified >= 150 and proj.recomputed >= 150
    # The plain bf16 argmax would have been wrong somewhere.
    assert not torch.equal(F.linear(h.bfloat16(), w.bfloat16()).argmax(-1), want)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_refined_top1_equals_fp32_argmax_at_its_margin(seed):
    """Ties of ~1e-4 relative sit at the refinement's margin: some are proven from the candidates'
    fp32 logits, the rest recomputed; all must give the full fp32 argmax."""
    w = _weights(seed)
    proj = OutputProjection(w, certify=True)
    h = _confident_and_tied(w, 400, seed, nudge=1e-4)
    assert torch.equal(proj.top1(h, _no_rules), F.linear(h, w).argmax(dim=-1))
    assert proj.refined >= 50 and proj.recomputed >= 50


@pytest.mark.parametrize("rows", [1, 7, 8, 40])
def test_calls_below_certify_from_take_the_fp32_top1(rows):
    """`verify_precision = "auto"`'s projection certifies calls of at least `certify_from` positions
    only; every call gives the fp32 argmax."""
    w = _weights(6)
    proj = OutputProjection(w, certify=True, certify_from=8)
    h = _confident_and_tied(w, rows, 6, nudge=1e-3)  # near ties, not within fp32 rounding
    assert torch.equal(proj.top1(h, _no_rules), F.linear(h, w).argmax(dim=-1))
    settled = proj.certified + proj.refined + proj.recomputed
    assert settled == (rows if rows >= 8 else 0)


def test_auto_certifies_wide_calls_only_where_it_pays(monkeypatch):
    """On a CPU where the certified top-1 pays, `auto` takes it from AUTO_CERTIFIED_ROWS positions,
    an explicit bf16-certified at every call; elsewhere `auto` is the plain fp32 top-1."""
    tr = Translator.load(ROOT / "models" / "gec-base")
    assert not tr.projection("fp32").certify
    monkeypatch.setattr(api, "certified_pays", lambda device: True)
    auto, explicit = tr.projection("auto"), tr.projection("bf16-certified")
    assert auto.certify and auto.certify_from == AUTO_CERTIFIED_ROWS
    assert explicit.certify and explicit.certify_from == 1
    monkeypatch.setattr(api, "certified_pays", lambda device: False)
    assert tr.projection("auto") is tr.projection("fp32")


def test_refinement_covers_a_vocabulary_smaller_than_its_width():
    """Hidden states almost orthogonal to all 12 rows: every token is a candidate, all fit."""
    w = _weights(5, vocab=12, dim=64)
    g = torch.Generator().manual_seed(5)
    null = torch.linalg.svd(w, full_matrices=True).Vh[12:]  # (52, 64), orthogonal to every row
    h = torch.randn(100, 52, generator=g) @ null + 1e-3 * torch.randn(100, 64, generator=g)
    proj = OutputProjection(w, certify=True)
    assert torch.equal(proj.top1(h, _no_rules), F.linear(h, w).argmax(dim=-1))
    assert proj.refined >= 50


@pytest.mark.parametrize("rows,vocab", [(64, 8000), (5, 8003), (300, 129), (1, 40001), (3, 50)])
def test_top2_and_first_argmax_equal_topk_and_argmax(rows, vocab):
    """The chunked reductions (chunks of equal maxima, a short last chunk, -inf rows and runs) give
    torch.topk(2)'s values and the first maximal index, as torch.argmax does, above and below
    CHUNKED_FROM logits."""
    g = torch.Generator().manual_seed(rows + vocab)
    for scale in (3, 1000):  # few values: ties within and across chunks; many: mostly distinct
        z = torch.randint(-scale, scale, (rows, vocab), generator=g).float()
        z[torch.rand(rows, vocab, generator=g) < 0.2] = float("-inf")
        z[0] = float("-inf")
        z[-1, -1] = z[-1].max() + 1  # the best in the short last chunk
        best, runner, first = top2(z)
        top = z.topk(2, dim=-1).values
        assert torch.equal(best, top[:, 0]) and torch.equal(runner, top[:, 1])
        assert torch.equal(first, z.argmax(dim=-1)) and torch.equal(first_argmax(z), first)


def test_exact_ties_take_the_first_index_as_fp32_argmax_does():
    w = _weights(4, vocab=500, dim=64)
    w[300] = w[100]  # identical logits for tokens 100 and 300 at every position
    proj = OutputProjection(w, certify=True)
    h = w[torch.tensor([100, 300, 5])] * 2
    assert proj.top1(h, _no_rules).tolist() == [100, 100, 5]
    assert proj.recomputed == 2


@pytest.mark.parametrize("scale,rows", [(0.05, 256), (1.0, 256), (30.0, 256), (1.0, 1), (1.0, 7)])
def test_bf16_error_stays_within_the_bound(scale, rows):
    """The proof assumes bf16 matmuls accumulate in fp32 (whatever kernel a row count picks);
    this checks the bound on this machine."""
    w = _weights(7) * scale
    proj = OutputProjection(w, certify=True)
    h = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(8)) * 3
    zf = F.linear(h, w)
    zb = F.linear(h.bfloat16(), proj.weight_bf16).float()
    bound = proj.abs_coef * h.norm(dim=1, keepdim=True) + proj.rel_coef * zb.abs()
    assert bool(((zb - zf).abs() <= bound).all())
    assert float(((zb - zf).abs() / bound).max()) > 1e-3  # the bound is not absurdly loose


def test_constraints_apply_before_certification():
    w = _weights(3, vocab=50, dim=32)
    proj = OutputProjection(w, certify=True)
    h = w[torch.tensor([1, 7, 9, 7])] * 3  # token 1 (pad) would win row 0; eos = 2
    out_index = torch.tensor([0, 5, 5, 0])
    max_len = torch.tensor([10, 5, 10, 10])

    got = proj.top1(h, Rules(out_index, max_len, pad=1, eos=2, min_len=1))
    ref = constrain_logits(F.linear(h, w), out_index, max_len, pad=1, eos=2, min_len=1)
    assert torch.equal(got, ref.argmax(-1))
    assert int(got[0]) != 1 and int(got[1]) == 2  # pad never wins; eos forced at max_len


@pytest.mark.parametrize("int8", [False, True])
def test_plain_top1_over_many_positions_applies_each_rows_rules(int8):
    """The plain top-1 takes its positions TOP1_ROWS at a time: every position keeps its own rules
    (pad, min_len, max_len, forced tokens) and equals the argmax of the constrained logits of all
    positions at once, fp32 and int8 (whose logits are also row for row those of one call)."""
    w = _weights(4, vocab=300, dim=32)
    b = torch.randn(300)
    n = 3 * TOP1_ROWS + 5
    g = torch.Generator().manual_seed(4)
    h = torch.randn(n, 32, generator=g) * 2
    h[::7] = w[1] * 3  # pad would win these
    out_index = torch.randint(0, 12, (n,), generator=g)
    max_len = torch.randint(3, 12, (n,), generator=g)
    forced = torch.tensor([5, 6])

    int8_weight = Int8Weight(w, b) if int8 else None
    proj = OutputProjection(w, certify=False, bias=b, int8=int8_weight)
    ref = constrain_logits(int8_weight(h) if int8 else F.linear(h, w, b), out_index, max_len, pad=1, eos=2, min_len=2,
                           forced=forced)
    got = proj.top1(h, Rules(out_index, max_len, pad=1, eos=2, min_len=2, forced=forced))
    assert torch.equal(got, ref.argmax(-1))
    assert (got != 1).all() and (got[out_index == 0] == 5).all() and (got[(out_index >= max_len) & (out_index >= 2)] == 2).all()


def test_certify_needs_fp32():
    with pytest.raises(ValueError, match="fp32 or half verifier"):
        OutputProjection(torch.zeros(4, 3, dtype=torch.float64), certify=True)


def _gec_sample(n: int) -> list[str]:
    """The first `n` sources of the shipped sample corpus's first shard."""
    table = pq.read_table(sorted((ROOT / "examples" / "data" / "gec-sample").glob("*.parquet"))[0])
    return table.column("src").to_pylist()[:n]


def test_a_bf16_verifier_certified_equals_its_fp32_top1():
    """A bf16 verifier's logits are fp32 products of its bf16 states: the certified top-1 gives the same
    tokens as they do, and certifies most positions (its states need no rounding)."""
    tr, src = Translator.load(ROOT / "models" / "gec-base"), _gec_sample(60)
    runs = {p: [r.tokens for r in tr.translate_batch(src, method="greedy", max_batch_size=16, precision="bf16",
                                                       verify_precision=p)] for p in ("fp32", "bf16-certified")}
    assert runs["fp32"] == runs["bf16-certified"]
    projection = tr.projection("bf16-certified", "bf16")
    assert projection.certify and projection.certified > 10 * (projection.refined + projection.recomputed)


def test_shipped_gec_model_same_outputs_in_both_precisions():
    """On the shipped gec-base and sample corpus: greedy and IAD, fp32 and certified bf16, agree."""
    tr, src = Translator.load(ROOT / "models" / "gec-base"), _gec_sample(80)
    runs = {(m, p): [r.tokens for r in tr.translate_batch(src, method=m, max_batch_size=16, verify_precision=p)]
            for m in ("greedy", "iad") for p in ("fp32", "bf16-certified")}
    ref = runs[("greedy", "fp32")]
    assert all(out == ref for out in runs.values())
    assert tr.projection("bf16-certified").certified > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_an_output_bias_is_covered_by_the_certificate(seed):
    """Marian/BART's final_logits_bias: folded into the certified product, added in the fp32 one;
    both give the argmax of the fp32 logits with the bias, ties included."""
    w = _weights(seed)
    bias = torch.randn(w.shape[0], generator=torch.Generator().manual_seed(seed)) * 2.0
    h = _confident_and_tied(w, 300, seed)
    want = F.linear(h, w, bias).argmax(dim=-1)
    certified = OutputProjection(w, certify=True, bias=bias)
    assert torch.equal(certified.top1(h, _no_rules), want)
    assert certified.certified > 0 and certified.draft_weight_bf16.shape == w.shape
    plain = OutputProjection(w, certify=False, bias=bias)
    assert torch.equal(plain.top1(h, _no_rules), want)
    assert torch.allclose(plain.logits(h), certified.logits(h), atol=1e-4)
    assert not torch.equal(OutputProjection(w, certify=True).top1(h, _no_rules), want)  # the bias matters
