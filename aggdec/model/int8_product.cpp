// The W8A8 product of an int8 verifier (CPU): aggdec::<OP>; its contract is in aggdec/model/int8_product.py.
// One call: each row of x quantized to int8 with a scale of its own, ATen's int8 x int8 -> int32 matmul,
// the int32 results rescaled in place (+ bias, relu). No Python between the three.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/empty.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace {

using at::vec::Vectorized;
using V = Vectorized<float>;

// x (N, D) fp32, rows contiguous -> xq (N, D) int8 and s (N): s = max(max |x_row|, tiny) / 127,
// xq = round(x / s) (to nearest, ties to even), as aggdec.model.precision.quantize_rows computes them
void quantize(const at::Tensor& x, at::Tensor& xq, at::Tensor& s) {
  const int64_t rows = x.size(0), d = x.size(1), ld = x.stride(0);
  const float* xp = x.data_ptr<float>();
  int8_t* qp = xq.data_ptr<int8_t>();
  float* sp = s.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    float tmp[V::size()];
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * ld;
      V top(0.f);
      int64_t i = 0;
      for (; i + V::size() <= d; i += V::size()) top = at::vec::maximum(top, V::loadu(row + i).abs());
      float amax = 0.f;
      top.store(tmp);
      for (int64_t j = 0; j < V::size(); ++j) amax = std::max(amax, tmp[j]);
      for (; i < d; ++i) amax = std::max(amax, std::abs(row[i]));
      const float scale = std::max(amax, std::numeric_limits<float>::min()) / 127.0f;
      sp[r] = scale;
      int8_t* out = qp + r * d;
      const V vs(scale);
      i = 0;
#if defined(CPU_CAPABILITY_AVX512)  // the rounding mode's nearest-even conversion, packed to int8
      const __m512 ws = _mm512_set1_ps(scale);
      for (; i + 16 <= d; i += 16)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                         _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(row + i), ws))));
#else
      for (; i + V::size() <= d; i += V::size()) {
        (V::loadu(row + i) / vs).round().store(tmp);
        for (int64_t j = 0; j < V::size(); ++j) out[i + j] = static_cast<int8_t>(tmp[j]);
      }
#endif
      for (; i < d; ++i) out[i] = static_cast<int8_t>(std::nearbyint(row[i] / scale));
    }
  });
}

// One row of acc (M int32) -> the same memory as fp32: acc * scale[col] (* sr), + bias[col], relu. Each
// product and sum rounded on its own, as ATen's separate operators round them (no FMA contraction: the
// attribute holds for this function's body, which the callers' lambda does not inline).
__attribute__((optimize("fp-contract=off"), noinline))
void rescale_row(int32_t* row, int64_t m, const float* scale, const float* sr, const float* bias, bool relu) {
  float* out = reinterpret_cast<float*>(row);
  for (int64_t i = 0; i < m; ++i) {
    float y = static_cast<float>(row[i]) * scale[i];
    if (sr) y = y * *sr;
    if (bias) y = y + bias[i];
    out[i] = relu ? std::max(y, 0.f) : y;
  }
}

// acc (N, M) int32 -> the same memory as fp32, row by row (s: a scale a row, or none for the ranking)
void rescale(at::Tensor& acc, const at::Tensor& scale, const float* s, const c10::optional<at::Tensor>& bias,
             bool relu) {
  const int64_t m = acc.size(1);
  int32_t* ap = acc.data_ptr<int32_t>();
  const float* cp = scale.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  at::parallel_for(0, acc.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rescale_row(ap + r * m, m, cp, s ? s + r : nullptr, bp, relu);
  });
}

at::Tensor int8_product(const at::Tensor& x, const at::Tensor& qweight_t, const at::Tensor& scale,
                        const c10::optional<at::Tensor>& bias, bool relu, bool ranking) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int8_product: x (N, D) fp32");
  TORCH_CHECK(qweight_t.dim() == 2 && qweight_t.scalar_type() == at::kChar && qweight_t.size(0) == x.size(1),
              "int8_product: qweight_t (D, M) int8");
  TORCH_CHECK(scale.dim() == 1 && scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.size(0) == qweight_t.size(1), "int8_product: scale (M,) fp32");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                        bias->size(0) == qweight_t.size(1)), "int8_product: bias (M,) fp32");
  const int64_t n = x.size(0);
  auto xq = at::empty({std::max<int64_t>(n, 2), x.size(1)}, x.options().dtype(at::kChar));
  auto s = at::empty({std::max<int64_t>(n, 2)}, x.options());
  quantize(x.stride(1) == 1 ? x : x.contiguous(), xq, s);
  if (n < 2) {  // _int_mm takes two rows at least: zero rows added, their results dropped
    xq.narrow(0, n, 2 - n).zero_();
    s.narrow(0, n, 2 - n).fill_(1.0f);
  }
  auto acc = at::_int_mm(xq, qweight_t);
  TORCH_CHECK(acc.is_contiguous(), "int8_product: _int_mm gave a non-contiguous result");
  rescale(acc, scale, ranking ? nullptr : s.data_ptr<float>(), bias, relu);
  auto y = acc.view(at::kFloat);
  return n < 2 ? y.narrow(0, 0, n) : y;
}

}  // namespace

// the operator's name, AGGDEC_INT8_OP, is set by the build (setup.py: int8_product.OP)
#define AGGDEC_STR(x) #x
#define AGGDEC_NAME(x) AGGDEC_STR(x)

TORCH_LIBRARY_FRAGMENT(aggdec, m) {
  m.def(AGGDEC_NAME(AGGDEC_INT8_OP)
        "(Tensor x, Tensor qweight_t, Tensor scale, Tensor? bias=None, bool relu=False, bool ranking=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(aggdec, CPU, m) { m.impl(AGGDEC_NAME(AGGDEC_INT8_OP), &int8_product); }
