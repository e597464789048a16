"""The verifier's output projection, and its top-1 computed in bfloat16 but certified exact.

Verification mostly needs the argmax of the (N, V) logits. A bf16 product is faster on CPUs with
native bf16, but its argmax sometimes differs from fp32's. `OutputProjection.top1` (certify=True)
bounds the bf16 error of every logit and keeps the bf16 argmax only where the bound proves the fp32
argmax is the same token; the others are settled in fp32. The result is the fp32 argmax everywhere.

Error bound, for z_i = sum_j W_ij h_j over D terms, u = 2^-8 (bf16 unit roundoff), g = D * 2^-24:
- rounding h and W to bf16 moves each product by at most (2u + u^2) |W_ij h_j|;
- the bf16 matmul accumulates in fp32 (oneDNN, cuBLAS), at most g (1 + u)^2 sum_j |W_ij h_j|;
- the fp32 reference itself is off from the exact sum by at most g' = (D + 1) * 2^-24 times the same;
- the bf16 result is rounded to bf16 once: at most u/(1 - u) |z_b,i|.
With sum_j |W_ij h_j| <= max_i ||W_i|| * ||h|| (Cauchy-Schwarz), every |z_b,i - z_fp32,i| is at most
    delta_i = A + r |z_b,i|,   A = (2u + u^2 + g (1 + u)^2 + g') * max_i ||W_i|| * ||h||,  r = u / (1 - u).
z_b,i + r |z_b,i| grows with z_b,i, so the top-1 a is certified when
    z_b,a - r |z_b,a| - A > z_b,b + r |z_b,b| + A     (b: the bf16 runner-up),
which makes z_fp32,a > z_fp32,i for every i != a.

Where that fails, only the candidates C = {i : z_b,i + delta_i >= L}, L = z_b,a - delta_a, can be the
fp32 argmax (no other z_fp32,i reaches L <= z_fp32,a). `OutputProjection._refine` computes their fp32
logits z_s,i from their weight rows alone (another summation order). Both are within g' max_i ||W_i||
||h|| of the exact value, so |z_s,i - z_fp32,i| <= E = 2 g' max_i ||W_i|| ||h||, and the candidate c
with the largest z_s,c is the fp32 argmax when z_s,c - E > z_s,j + E for every other candidate j.
Positions where that also fails (ties, or more than REFINE_WIDTH candidates) get the full fp32 row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from aggdec.model.linear import linear, plain, prepack
from aggdec.thresholds import CHUNKED_FROM, REDUCE_CHUNK, REFINE_WIDTH, TOP1_ROWS

BF16_UNIT_ROUNDOFF = 2.0**-8
FP32_UNIT_ROUNDOFF = 2.0**-24


@dataclass
class Rules:
    """fairseq-generate's per-step rules at the verified positions, with no host read: `out_index` (N,)
    the output index each predicts (0 = first target token), `max_len` (N,) its row's limit. pad is
    never produced; eos is forbidden before `min_len` tokens; at index max_len only eos is allowed.
    forced (F,) int64, optional: the token at output index i < F is forced[i] (aggdec.conventions), with
    logit 0 and every other token -inf. `apply` constrains whole logits; the top-1's path takes the
    argmax of `mask`ed ones under `override`, the same token."""

    out_index: torch.Tensor
    max_len: torch.Tensor
    pad: int
    eos: int
    min_len: int = 1
    forced: torch.Tensor | None = None

    def mask(self, logits: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """In place on the logits (n, V) of positions `rows` (None: all): pad never, eos not before `min_len`."""
        logits[..., self.pad] = -math.inf
        if self.min_len > 0:
            index = self.out_index if rows is None else self.out_index[rows]
            logits[..., self.eos].masked_fill_(index < self.min_len, -math.inf)
        return logits

    def forcing(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(where a forced first token is due (N,) bool, that token (N,)); only with `forced` tokens."""
        n = self.forced.numel()
        return self.out_index < n, self.forced[self.out_index.clamp(max=n - 1)]

    def override(self, top1: torch.Tensor) -> torch.Tensor:
        """The argmax (N,) of `mask`ed logits -> that of the constrained ones: eos at the length limit,
        forced tokens where due."""
        top1 = torch.where(self.out_index >= self.max_len, self.eos, top1)
        if self.forced is not None and self.forced.numel():
            at, token = self.forcing()
            top1 = torch.where(at, token, top1)
        return top1

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rule, in place, on the logits (N, V)."""
        self.mask(logits)
        force = self.out_index >= self.max_len
        eos_col = logits[..., self.eos].clone()
        logits.masked_fill_(force[..., None], -math.inf)
        logits[..., self.eos] = torch.where(force, eos_col, logits[..., self.eos])
        if self.forced is not None and self.forced.numel():
            at, token = self.forcing()
            logits.masked_fill_(at[..., None], -math.inf)
            kept = logits.gather(-1, token[..., None])[..., 0]
            logits.scatter_(-1, token[..., None], torch.where(at, 0.0, kept)[..., None])
        return logits


def _chunked(z: torch.Tensor) -> bool:
    """Whether `top2` searches chunks of z: fp32 rows (N, V) on the CPU outside `linear.plain_products`, of
    several REDUCE_CHUNK chunks and CHUNKED_FROM logits or more (ATen's index-returning reductions take
    several times as long as `amax`'s passes there)."""
    return (z.dim() == 2 and z.dtype == torch.float32 and z.device.type == "cpu" and z.numel() >= CHUNKED_FROM
            and z.shape[1] >= 2 * REDUCE_CHUNK and not plain())


def top2(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(largest, second largest (the largest again where it occurs twice), first index of the largest)
    over the last dim of z (N, V), as torch.topk(2)'s values and torch.max(dim=-1)'s index; `_chunked`:
    from the chunks' maxima by `amax` (the last chunk may be short), within the first best chunk."""
    if not _chunked(z):
        best, runner = z.topk(2, dim=-1).values.unbind(dim=1)
        return best, runner, z.max(dim=-1).indices
    (n, v), c = z.shape, REDUCE_CHUNK
    peaks = z.as_strided((n, v // c, c), (z.stride(0), c, 1)).amax(-1)
    if v % c:
        peaks = torch.cat([peaks, z[:, v - v % c:].amax(-1, keepdim=True)], dim=1)
    at = peaks.max(dim=-1, keepdim=True).indices * c + torch.arange(c, device=z.device)
    inner = z.gather(1, at.clamp(max=v - 1)).masked_fill_(at >= v, -math.inf)
    best, second = inner.topk(2, dim=-1).values.unbind(dim=1)
    runner = torch.maximum(peaks.topk(2, dim=-1).values[:, 1], second)
    return best, runner, at.gather(1, inner.max(dim=-1, keepdim=True).indices).squeeze(1)


def first_argmax(z: torch.Tensor) -> torch.Tensor:
    """The first index of the largest value over the last dim of z, as torch.argmax (`top2`)."""
    return top2(z)[2] if _chunked(z) else z.max(dim=-1).indices


def draft_argmax(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim via topk(1), faster on CPU; ties may resolve differently: drafts only."""
    return logits.topk(1, dim=-1).indices.squeeze(-1)


def certified_pays(device: torch.device) -> bool:
    """Whether the certified bf16 top-1 is expected to beat fp32 on `device`, on calls of at least
    `AUTO_CERTIFIED_ROWS` positions: a CPU with AMX tiles or AVX512-BF16 (docs/design.md, "Certified bf16
    top-1")."""
    caps = getattr(torch.cpu, "get_capabilities", dict)()
    return device.type == "cpu" and bool(caps.get("amx_tile") or caps.get("avx512_bf16"))


class OutputProjection:
    """logits = hidden @ weight.T (+ bias) with weight (V, D) fp32, plus a bf16 copy for the certified
    top-1. A half-precision verifier's weight is kept as an fp32 copy and its states multiplied in
    fp32, so that no tie made by rounding logits to 16 bits (in an order the call's shape picks)
    decides a token. With the certified top-1, a bias (V,) is folded in as one more weight column
    against a constant 1 appended to every hidden state, so that the bound above covers it unchanged.
    int8: the quantized output projection (aggdec.model.precision.Int8Weight, bias included), which
    then computes the logits (no certified top-1). Built once per set of weights (snapshots); `pack=False`
    keeps no oneDNN copy of the weight (a traced step's projection).

    `certify=False` makes `top1` the plain fp32 argmax, as do calls of fewer than `certify_from`
    positions. Counters of positions: `certified` by the bf16 bound, `refined` from their candidates'
    fp32 logits, `recomputed` as whole fp32 rows."""

    def __init__(self, weight: torch.Tensor, certify: bool, bias: torch.Tensor | None = None, int8=None,
                 certify_from: int = 1, pack: bool = True):
        if certify and (weight.dtype == torch.float64 or int8 is not None):
            raise ValueError(f"certified bf16 top-1 needs an fp32 or half verifier, got {'int8' if int8 else weight.dtype}")
        self.int8 = int8
        if int8 is None and weight.dtype in (torch.bfloat16, torch.float16):  # fp32 logits (class docstring)
            weight, bias = weight.detach().float(), None if bias is None else bias.detach().float()
        self.with_bias = bias is not None and certify  # folded into the weight
        self.bias = None if bias is None or certify else bias.detach()
        if self.with_bias:
            weight = torch.cat([weight.detach(), bias.detach()[:, None]], dim=1)
        self.weight = weight
        self.certify, self.certify_from = certify, certify_from
        self.weight_bf16 = self.abs_coef = self.rel_coef = self.packed_bf16 = self.draft_weight_bf16 = None
        # an int8 projection never uses the float weight
        self.packed = prepack(weight) if int8 is None and pack else None
        if certify:  # the bf16 copy and the bound's coefficients, once
            self.weight_bf16 = weight.detach().bfloat16()
            # drafters' bf16 output weight (V, D): without the bias column, which drafters add themselves
            self.draft_weight_bf16 = self.weight_bf16[:, :-1].contiguous() if self.with_bias else self.weight_bf16
            self.packed_bf16 = prepack(self.weight_bf16)
            d = weight.shape[1]
            g, g_ref = d * FP32_UNIT_ROUNDOFF, (d + 1) * FP32_UNIT_ROUNDOFF
            u = BF16_UNIT_ROUNDOFF
            max_norm = float(weight.detach().norm(dim=1).max())
            self.abs_coef = (2 * u + u * u + g * (1 + u) ** 2 + g_ref) * max_norm
            self.rel_coef = u / (1 - u)
            self.ref_coef = 2 * g_ref * max_norm
        self.certified = self.refined = self.recomputed = 0

    def _extend(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (N, D) -> (N, D + 1) with a constant 1 where the weight carries the bias."""
        return F.pad(hidden, (0, 1), value=1.0) if self.with_bias else hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (N, D) -> fp32 logits (N, V) (float64 for a float64 verifier)."""
        return self._logits(self._extend(hidden))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            return self.int8(hidden)
        return linear(hidden.to(self.weight.dtype), self.weight, self.bias, packed=self.packed)

    def top1(self, hidden: torch.Tensor, rules: Rules) -> torch.Tensor:
        """Argmax (N,) int64 of the fp32 logits of hidden (N, D) constrained by `rules`. With no host read
        where `certify` is off."""
        hidden = self._extend(hidden.to(self.weight.dtype))  # a half verifier's states, exactly in fp32
        n = hidden.shape[0]
        if self.certify and n >= self.certify_from:
            top1 = self._certified_top1(hidden, rules)
        elif n <= TOP1_ROWS or plain():  # (a traced step: one product, any N)
            top1 = self._plain_top1(hidden, rules, None)
        else:
            at = torch.arange(n, device=hidden.device)
            top1 = torch.cat([self._plain_top1(hidden[i : i + TOP1_ROWS], rules, at[i : i + TOP1_ROWS])
                              for i in range(0, n, TOP1_ROWS)])
        return rules.override(top1)

    def _plain_top1(self, hidden: torch.Tensor, rules: Rules, rows: torch.Tensor | None) -> torch.Tensor:
        """The argmax of the masked logits (`Rules.mask`) of `rows` (None: all), hidden the extended states
        of those rows (`first_argmax`: the first maximal index, as argmax)."""
        z = self._logits(hidden) if self.int8 is None else self.int8.ranking_logits(hidden)
        return first_argmax(rules.mask(z, rows))

    def _certified_top1(self, hidden: torch.Tensor, rules: Rules) -> torch.Tensor:
        """The argmax of the masked logits (`Rules.mask`), from the bf16 product where the bound proves it."""
        zb = rules.mask(linear(hidden.bfloat16(), self.weight_bf16, packed=self.packed_bf16))
        best, runner, pred = top2(zb.float())
        r = self.rel_coef
        h_norm = hidden.norm(dim=1)
        slack = self.abs_coef * h_norm
        floor = best * (1 - r * best.sign()) - slack  # L: the least fp32 value of the bf16 top-1
        ok = floor > runner * (1 + r * runner.sign()) + slack  # -inf stays -inf (a constrained runner-up)
        n_ok = int(ok.sum())
        self.certified += n_ok
        if n_ok == pred.shape[0]:
            return pred
        redo = (~ok).nonzero().squeeze(1)
        refined, done = self._refine(hidden[redo], zb[redo], floor[redo], h_norm[redo])
        pred[redo[done]] = refined[done]
        self.refined += int(done.sum())
        redo = redo[~done]
        if redo.numel():
            pred[redo] = rules.mask(self._logits(hidden[redo]), redo).argmax(dim=-1)
            self.recomputed += redo.numel()
        return pred

    def _refine(self, hidden: torch.Tensor, zb: torch.Tensor, floor: torch.Tensor,
                h_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp32 argmax from the candidates' fp32 logits (module docstring). hidden (n, D), zb (n, V)
        masked bf16 logits, floor L and h_norm ||h|| (n,). -> (argmax (n,) int64, proven (n,) bool)."""
        slack = self.abs_coef * h_norm
        width = min(REFINE_WIDTH, zb.shape[1])
        top = zb.topk(width, dim=-1)
        v = top.values.float()
        cand = v * (1 + self.rel_coef * v.sign()) + slack[:, None] >= floor[:, None]  # a leading run
        # Every candidate is among the top `width` when the last of them is out (or that is all of V).
        complete = ~cand[:, -1] | (width == zb.shape[1])
        rows = self.weight[top.indices]  # (n, m, D) fp32
        zs = torch.bmm(rows, hidden[:, :, None]).squeeze(2).masked_fill(~cand, -math.inf)
        two = zs.topk(min(2, zs.shape[1]), dim=-1)
        margin = 2 * self.ref_coef * h_norm
        runner = two.values[:, 1] if two.values.shape[1] > 1 else torch.full_like(margin, -math.inf)
        proven = complete & (two.values[:, 0] - runner > margin)
        return top.indices.gather(1, two.indices[:, :1]).squeeze(1), proven
