// Attention of a few decoder queries per row over each query's own number of keys (CPU).
// The operator aggdec::<OP>; its contract is in aggdec/model/decode_attention.py.
// ATen's headers alone (not torch/extension.h, which doubles the build's time): no Python here
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using at::vec::Vectorized;

template <typename T>
T sum_all(Vectorized<T> x) {
  return at::vec::vec_reduce_all<T>([](Vectorized<T>& a, Vectorized<T>& b) { return a + b; }, x);
}

// a . b over n elements
template <typename T>
T dot(const T* a, const T* b, int64_t n) {
  using V = Vectorized<T>;
  V acc(T(0));
  int64_t i = 0;
  for (; i + V::size() <= n; i += V::size()) acc = at::vec::fmadd(V::loadu(a + i), V::loadu(b + i), acc);
  if (i < n) acc = at::vec::fmadd(V::loadu(a + i, n - i), V::loadu(b + i, n - i), acc);
  return sum_all(acc);
}

template <typename T>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& count,
            const c10::optional<at::Tensor>& key_rows, const c10::optional<at::Tensor>& bias, double score_scale,
            int64_t heads, at::Tensor& out) {
  using V = Vectorized<T>;
  const int64_t rows = q.size(0), queries = q.size(1), dim = q.size(2), keys = k.size(1), dh = dim / heads;
  const T scale = static_cast<T>(score_scale);
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t* cp = count.data_ptr<int64_t>();
  const int64_t* rp = key_rows ? key_rows->data_ptr<int64_t>() : nullptr;  // key j of row b: row rp[b, j] of k, v
  const int64_t r0 = key_rows ? key_rows->stride(0) : 0, r1 = key_rows ? key_rows->stride(1) : 0;
  const T* bp = bias ? bias->data_ptr<T>() : nullptr;  // score bias of (row b, head h, query t, key j)
  const int64_t b0 = bias ? bias->stride(0) : 0, b1 = bias ? bias->stride(1) : 0;
  const int64_t b2 = bias ? bias->stride(2) : 0, b3 = bias ? bias->stride(3) : 0;
  T* op = out.data_ptr<T>();
  const int64_t q0 = q.stride(0), q1 = q.stride(1), k0 = k.stride(0), k1 = k.stride(1);
  const int64_t v0 = v.stride(0), v1 = v.stride(1), c0 = count.stride(0), c1 = count.stride(1);
  // one task is one (row, query, head); small problems stay on one thread
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, keys * dh));
  at::parallel_for(0, rows * queries * heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<T> w(std::max<int64_t>(keys, 1) + V::size());  // room for whole vectors past the keys
    std::vector<const T*> kj(std::max<int64_t>(keys, 1)), vj(std::max<int64_t>(keys, 1));  // a task's keys, values
    // softmax(q k^T * scale + bias) v of one (row b, query t, head h) over its first n keys
    const auto one = [&](int64_t b, int64_t t, int64_t h) {
      const int64_t n = std::min<int64_t>(cp[b * c0 + t * c1], keys);
      const T* qi = qp + b * q0 + t * q1 + h * dh;
      T* oi = op + (b * queries + t) * dim + h * dh;
      if (n <= 0) {  // no key: a softmax over nothing, as the masked softmax gives
        std::fill(oi, oi + dh, std::numeric_limits<T>::quiet_NaN());
        return;
      }
      for (int64_t j = 0; j < n; ++j) {
        const int64_t r = rp ? rp[b * r0 + j * r1] : b;
        kj[j] = kp + r * k0 + j * k1 + h * dh;
        vj[j] = vp + r * v0 + j * v1 + h * dh;
      }
      T top = -std::numeric_limits<T>::infinity();
      if (bp) {
        const T* bi = bp + b * b0 + h * b1 + t * b2;
        for (int64_t j = 0; j < n; ++j) {
          w[j] = dot(qi, kj[j], dh) * scale + bi[j * b3];
          top = std::max(top, w[j]);
        }
      } else {
        for (int64_t j = 0; j < n; ++j) {
          w[j] = dot(qi, kj[j], dh) * scale;
          top = std::max(top, w[j]);
        }
      }
      // exp(w - top) in place, whole vectors (w has room past n; lanes past n are left out of the sum):
      // masked stores would keep the weights' next loads from being forwarded from the stores
      const V vtop(top);
      V vsum(T(0));
      int64_t j = 0;
      for (; j + V::size() <= n; j += V::size()) {
        const V e = (V::loadu(w.data() + j) - vtop).exp();
        e.store(w.data() + j);
        vsum = vsum + e;
      }
      if (j < n) {
        const V e = (V::loadu(w.data() + j) - vtop).exp();
        e.store(w.data() + j);
        vsum = vsum + V::set(V(T(0)), e, n - j);
      }
      const V vtotal(sum_all(vsum));
      // the values' sum weighted by exp(w - top), in registers (two partial sums: even and odd keys),
      // divided by the weights' sum
      for (int64_t d = 0; d < dh; d += V::size()) {
        const int64_t m = std::min<int64_t>(V::size(), dh - d);
        V even(T(0)), odd(T(0));
        int64_t r = 0;
        for (; r + 1 < n; r += 2) {
          even = at::vec::fmadd(V(w[r]), V::loadu(vj[r] + d, m), even);
          odd = at::vec::fmadd(V(w[r + 1]), V::loadu(vj[r + 1] + d, m), odd);
        }
        if (r < n) even = at::vec::fmadd(V(w[r]), V::loadu(vj[r] + d, m), even);
        ((even + odd) / vtotal).store(oi + d, m);
      }
    };
    int64_t h = begin % heads, t = (begin / heads) % queries, b = begin / (heads * queries);
    for (int64_t task = begin; task < end; ++task) {
      one(b, t, h);
      if (++h == heads) {
        h = 0;
        if (++t == queries) {
          t = 0;
          ++b;
        }
      }
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& count,
                            int64_t heads, const c10::optional<at::Tensor>& rows,
                            const c10::optional<at::Tensor>& bias, c10::optional<double> scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && count.dim() == 2,
              "decode_attention: q, k, v (B,T|L,D) and count (B,T)");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == q.size(2) && count.size(0) == q.size(0) &&
                  count.size(1) == q.size(1) && q.size(2) % heads == 0, "decode_attention: mismatched shapes");
  TORCH_CHECK(rows ? rows->dim() == 2 && rows->size(0) == q.size(0) && rows->size(1) == k.size(1) &&
                         rows->scalar_type() == at::kLong
                   : k.size(0) == q.size(0),
              "decode_attention: rows (B,L) int64, or keys of B rows");
  TORCH_CHECK(count.scalar_type() == at::kLong && k.scalar_type() == q.scalar_type() &&
                  v.scalar_type() == q.scalar_type(), "decode_attention: dtypes");
  TORCH_CHECK(!bias || (bias->dim() == 4 && bias->size(0) == q.size(0) && bias->size(1) == heads &&
                        bias->size(2) == q.size(1) && bias->size(3) == k.size(1) &&
                        bias->scalar_type() == q.scalar_type()),
              "decode_attention: bias (B,heads,T,L) of q's dtype");
  if (rows) {  // every entry a query will read names a row of k and v (the reads are unchecked)
    const int64_t* rp = rows->data_ptr<int64_t>();
    const int64_t* cp = count.data_ptr<int64_t>();
    const int64_t r0 = rows->stride(0), r1 = rows->stride(1), c0 = count.stride(0), c1 = count.stride(1);
    const int64_t batch = q.size(0), queries = q.size(1), k_rows = k.size(0), keys = k.size(1);
    for (int64_t b = 0; b < batch; ++b) {
      int64_t n = 0;
      for (int64_t t = 0; t < queries; ++t) n = std::max(n, cp[b * c0 + t * c1]);
      for (int64_t j = 0; j < std::min(n, keys); ++j) {
        const int64_t r = rp[b * r0 + j * r1];
        TORCH_CHECK(0 <= r && r < k_rows, "decode_attention: rows[", b, ", ", j, "] = ", r, " is not a row of k");
      }
    }
  }
  const auto last = [](const at::Tensor& x) { return x.stride(2) == 1 ? x : x.contiguous(); };
  const at::Tensor qc = last(q), kc = last(k), vc = last(v);
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  const double s = scale ? *scale : std::pow(static_cast<double>(q.size(2) / heads), -0.5);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "decode_attention",
                             [&] { attend<scalar_t>(qc, kc, vc, count, rows, bias, s, heads, out); });
  return out;
}

}  // namespace

// the operator's name, AGGDEC_OP, is set by the build (setup.py: decode_attention.OP)
#define AGGDEC_STR(x) #x
#define AGGDEC_NAME(x) AGGDEC_STR(x)

TORCH_LIBRARY(aggdec, m) {
  m.def(AGGDEC_NAME(AGGDEC_OP)
        "(Tensor q, Tensor k, Tensor v, Tensor count, int heads, Tensor? rows=None, Tensor? bias=None, "
        "float? scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(aggdec, CPU, m) { m.impl(AGGDEC_NAME(AGGDEC_OP), &decode_attention); }
