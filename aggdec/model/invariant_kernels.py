"""The Triton kernels of the batch-invariant verifier (aggdec.model.invariant, which launches them).

Each kernel computes every output row from that row's inputs alone, in an order fixed by constants that
never depend on the number of rows or tokens in the call:
- `linear_kernel`: x (M, K) @ w (N, K).T in tiles of BLOCK_M x BLOCK_N over the whole of K, in BLOCK_K
  steps (no split-K), in IEEE fp32 (`input_precision="ieee"`, not TF32); half operands are widened to
  fp32 first (their products are exact there), so they accumulate in fp32 too.
- `norm_kernel`: a layer norm (or T5's RMS norm) of each row over one block of its D values.
- `attention_kernel`: each query's softmax over its own keys 0 .. count - 1, in blocks of BLOCK_N keys
  from key 0 (online softmax): a query's arithmetic depends on its own key count, never on the span
  read or the other queries of its tile (blocks past its count change nothing: exact ones and zeros).
Importing this module imports Triton; with `TRITON_INTERPRET=1` set first, the kernels run on CPU tensors.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def linear_kernel(x, w, b, y, M, N, K, sxm, swn, sym, HAS_BIAS: tl.constexpr, RELU: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[m, n] = sum_k x[m, k] w[n, k] (+ b[n]) (relu); last dimensions contiguous."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        a = tl.load(x + rm[:, None] * sxm + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        bt = tl.load(w + rn[None, :] * swn + k[:, None], mask=(rn[None, :] < N) & (k[:, None] < K), other=0.0)
        acc += tl.dot(a.to(tl.float32), bt.to(tl.float32), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(b + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if RELU:
        acc = tl.maximum(acc, 0.0)
    tl.store(y + rm[:, None] * sym + rn[None, :], acc.to(y.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def norm_kernel(x, w, b, y, M, D, sxm, sym, eps, RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """y = (x - mean) / sqrt(var + eps) * w + b per row (RMS: x / sqrt(mean(x^2) + eps) * w), in fp32."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    live = (r[:, None] < M) & (d[None, :] < D)
    v = tl.load(x + r[:, None] * sxm + d[None, :], mask=live, other=0.0).to(tl.float32)
    if RMS:
        c = v
    else:
        c = tl.where(live, v - tl.sum(v, axis=1)[:, None] / D, 0.0)
    h = c / tl.sqrt(tl.sum(c * c, axis=1)[:, None] / D + eps)
    h = h * tl.load(w + d, mask=d < D, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        h += tl.load(b + d, mask=d < D, other=0.0).to(tl.float32)[None, :]
    tl.store(y + r[:, None] * sym + d[None, :], h.to(y.dtype.element_ty), mask=live)


@triton.jit
def attention_kernel(q, k, v, count, rows, bias, out, NQ, T, DH, scale,
                     sqb, sqt, skb, skl, svb, svl, scb, sct, srb, srl, sbb, sbh, sbt, sbl, sob, sot,
                     HAS_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Queries i = b * T + t of one head (program axis 1): softmax(q k^T * scale + bias) v over keys
    0 .. count[b, t] - 1 of row b (of row rows[b, j] for key j), in fp32."""
    h = tl.program_id(1)
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    qm = i < NQ
    bq, tq = i // T, i % T
    d = tl.arange(0, BLOCK_D)
    dm = d < DH
    col = h * DH + d
    qv = tl.load(q + bq[:, None] * sqb + tq[:, None] * sqt + col[None, :], mask=qm[:, None] & dm[None, :],
                 other=0.0).to(tl.float32)
    n = tl.load(count + bq * scb + tq * sct, mask=qm, other=0)
    m = tl.full((BLOCK_M,), -1e30, tl.float32)
    total = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for j0 in range(0, tl.max(n, axis=0), BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        live = qm[:, None] & (j[None, :] < n[:, None])  # (M, N)
        if HAS_ROWS:
            src = tl.load(rows + bq[:, None] * srb + j[None, :] * srl, mask=live, other=0)
        else:
            src = bq[:, None] + 0 * j[None, :]
        at = live[:, :, None] & dm[None, None, :]
        kk = tl.load(k + src[:, :, None] * skb + j[None, :, None] * skl + col[None, None, :], mask=at,
                     other=0.0).to(tl.float32)
        s = tl.sum(qv[:, None, :] * kk, axis=2) * scale
        if HAS_BIAS:
            s += tl.load(bias + bq[:, None] * sbb + h * sbh + tq[:, None] * sbt + j[None, :] * sbl, mask=live,
                         other=0.0).to(tl.float32)
        s = tl.where(live, s, float("-inf"))
        top = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.where(top == m, 1.0, tl.exp(m - top))  # exactly 1 where the block added no key
        p = tl.where(live, tl.exp(s - top[:, None]), 0.0)
        vv = tl.load(v + src[:, :, None] * svb + j[None, :, None] * svl + col[None, None, :], mask=at,
                     other=0.0).to(tl.float32)
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vv, axis=1)
        m = top
    o = acc / tl.where(qm, total, 1.0)[:, None]  # (a query without keys: NaN, as masked softmax gives)
    tl.store(out + bq[:, None] * sob + tq[:, None] * sot + col[None, :], o.to(out.dtype.element_ty),
             mask=qm[:, None] & dm[None, :])
