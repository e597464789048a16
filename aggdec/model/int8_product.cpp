// The W8A8 product of an int8 verifier (CPU): aggdec::<OP>; its contract is in aggdec/model/int8_product.py.
// One call: each row of x quantized to int8 with a scale of its own; the integer product, either oneDNN's
// on the weight it prepacked (u8 x s8, x_q + 128 with zero point 128, each sum converted to fp32) or
// ATen's int8 x int8 -> int32 matmul; the sums rescaled in place (+ bias, relu). No Python between them.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string_view>
#include <type_traits>
#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace {

using at::vec::Vectorized;
using V = Vectorized<float>;

// x (N, D) fp32, rows contiguous -> xq (N, D) and s (N): s = max(max |x_row|, tiny) / 127, q = round(x / s)
// (to nearest, ties to even), as aggdec.model.precision.quantize_rows computes them; xq = q, int8, or
// q + 128, uint8 (T)
template <typename T>
void quantize(const at::Tensor& x, at::Tensor& xq, at::Tensor& s) {
  constexpr int offset = std::is_same_v<T, uint8_t> ? 128 : 0;
  const int64_t rows = x.size(0), d = x.size(1), ld = x.stride(0);
  const float* xp = x.data_ptr<float>();
  T* qp = xq.data_ptr<T>();
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
      T* out = qp + r * d;
      const V vs(scale);
      i = 0;
#if defined(CPU_CAPABILITY_AVX512)  // the rounding mode's nearest-even conversion, packed to int8 (+ offset)
      const __m512 ws = _mm512_set1_ps(scale);
      const __m128i wo = _mm_set1_epi8(static_cast<char>(offset));  // + 128 on |q| <= 127: the sign bit flipped
      for (; i + 16 <= d; i += 16)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                         _mm_xor_si128(wo, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(
                                               _mm512_div_ps(_mm512_loadu_ps(row + i), ws)))));
#else
      for (; i + V::size() <= d; i += V::size()) {
        (V::loadu(row + i) / vs).round().store(tmp);
        for (int64_t j = 0; j < V::size(); ++j) out[i + j] = static_cast<T>(static_cast<int>(tmp[j]) + offset);
      }
#endif
      for (; i < d; ++i) out[i] = static_cast<T>(static_cast<int>(std::nearbyint(row[i] / scale)) + offset);
    }
  });
}

// One row of sums (M, int32 or fp32 T) -> the same memory as fp32: float(acc) * scale[col] (* sr),
// + bias[col], relu. Each product and sum rounded on its own, as ATen's separate operators round them (no
// FMA contraction: the attribute holds for this function's body, which the callers' lambda does not inline).
template <typename T>
__attribute__((optimize("fp-contract=off"), noinline))
void rescale_row(T* row, int64_t m, const float* scale, const float* sr, const float* bias, bool relu) {
  float* out = reinterpret_cast<float*>(row);
  for (int64_t i = 0; i < m; ++i) {
    float y = static_cast<float>(row[i]) * scale[i];
    if (sr) y = y * *sr;
    if (bias) y = y + bias[i];
    out[i] = relu ? std::max(y, 0.f) : y;
  }
}

// acc (N, M) int32 or fp32 sums, contiguous -> the same memory as fp32, row by row (s: a scale a row, or
// none for the ranking)
template <typename T>
void rescale(at::Tensor& acc, const at::Tensor& scale, const float* s, const c10::optional<at::Tensor>& bias,
             bool relu) {
  const int64_t m = acc.size(1);
  T* ap = acc.data_ptr<T>();
  const float* cp = scale.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  at::parallel_for(0, acc.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rescale_row(ap + r * m, m, cp, s ? s + r : nullptr, bp, relu);
  });
}

// xu8 (N, D) uint8 (x_q + 128) @ the weight oneDNN prepacked (torch.ops.onednn.qlinear_prepack of the
// (M, D) int8 weight) -> (N, M) fp32: each exact int32 sum of x_q * w, converted to fp32 (scales 1)
at::Tensor onednn_product(const at::Tensor& xu8, const at::Tensor& packed) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("onednn::qlinear_pointwise", "")
          .typed<at::Tensor(at::Tensor, double, int64_t, at::Tensor, at::Tensor, at::Tensor,
                            std::optional<at::Tensor>, double, int64_t, std::optional<at::ScalarType>,
                            std::string_view, c10::List<std::optional<at::Scalar>>, std::string_view)>();
  static const auto one = at::ones({}, at::kFloat);
  static const auto zero = at::zeros({}, at::kInt);
  return op.call(xu8, 1.0, 128, packed, one, zero, std::nullopt, 1.0, 0, at::kFloat, "none",
                 c10::List<std::optional<at::Scalar>>(), "");
}

at::Tensor int8_product(const at::Tensor& x, const at::Tensor& qweight_t, const at::Tensor& scale,
                        const c10::optional<at::Tensor>& bias, bool relu, bool ranking,
                        const c10::optional<at::Tensor>& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int8_product: x (N, D) fp32");
  TORCH_CHECK(qweight_t.dim() == 2 && qweight_t.scalar_type() == at::kChar && qweight_t.size(0) == x.size(1),
              "int8_product: qweight_t (D, M) int8");
  TORCH_CHECK(scale.dim() == 1 && scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.size(0) == qweight_t.size(1), "int8_product: scale (M,) fp32");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                        bias->size(0) == qweight_t.size(1)), "int8_product: bias (M,) fp32");
  TORCH_CHECK(!packed || (packed->is_mkldnn() && packed->dim() == 2 && packed->size(0) == qweight_t.size(0) &&
                          packed->size(1) == qweight_t.size(1)), "int8_product: packed, qweight_t prepacked");
  const int64_t n = x.size(0);
  const auto xc = x.stride(1) == 1 ? x : x.contiguous();
  if (packed) {
    auto xu8 = at::empty({n, x.size(1)}, x.options().dtype(at::kByte));
    auto s = at::empty({n}, x.options());
    quantize<uint8_t>(xc, xu8, s);
    auto y = onednn_product(xu8, *packed);
    TORCH_CHECK(y.is_contiguous() && y.scalar_type() == at::kFloat, "int8_product: oneDNN gave no (N, M) fp32");
    rescale<float>(y, scale, ranking ? nullptr : s.data_ptr<float>(), bias, relu);
    return y;
  }
  auto xq = at::empty({std::max<int64_t>(n, 2), x.size(1)}, x.options().dtype(at::kChar));
  auto s = at::empty({std::max<int64_t>(n, 2)}, x.options());
  quantize<int8_t>(xc, xq, s);
  if (n < 2) {  // _int_mm takes two rows at least: zero rows added, their results dropped
    xq.narrow(0, n, 2 - n).zero_();
    s.narrow(0, n, 2 - n).fill_(1.0f);
  }
  auto acc = at::_int_mm(xq, qweight_t);
  TORCH_CHECK(acc.is_contiguous(), "int8_product: _int_mm gave a non-contiguous result");
  rescale<int32_t>(acc, scale, ranking ? nullptr : s.data_ptr<float>(), bias, relu);
  auto y = acc.view(at::kFloat);
  return n < 2 ? y.narrow(0, 0, n) : y;
}

}  // namespace

// the operator's name, AGGDEC_INT8_OP, is set by the build (setup.py: int8_product.OP)
#define AGGDEC_STR(x) #x
#define AGGDEC_NAME(x) AGGDEC_STR(x)

TORCH_LIBRARY_FRAGMENT(aggdec, m) {
  m.def(AGGDEC_NAME(AGGDEC_INT8_OP)
        "(Tensor x, Tensor qweight_t, Tensor scale, Tensor? bias=None, bool relu=False, bool ranking=False, "
        "Tensor? packed=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(aggdec, CPU, m) { m.impl(AGGDEC_NAME(AGGDEC_INT8_OP), &int8_product); }
// a prepacked weight, an mkldnn tensor, makes the call MkldnnCPU's
TORCH_LIBRARY_IMPL(aggdec, MkldnnCPU, m) { m.impl(AGGDEC_NAME(AGGDEC_INT8_OP), &int8_product); }
