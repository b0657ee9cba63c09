// quantgate's fused CPU quantizer kernels (quantgate/quant/fused.py builds and loads them).
//
// Each kernel does in one pass over a tensor what the eager reference (quantizers.fake_int and ActQuant's
// per-token ranges) does in six to eight, with the same float32 operations in the same order, so that the
// results are bit-identical to it: x widened to float32 (exact), q = x * r (r = 1 / scale, computed by torch),
// rounded half to even, clamped to [qmin - z, qmax - z] (NaN kept, as torch.clamp keeps it), times the scale,
// rounded back to x's dtype (round to nearest even, c10's conversion). Bit-identical but for the sign of a zero
// where a rounded -0.0 meets a bound of 0 (asymmetric ranges): torch's own clamp gives either sign there,
// depending on where its vectorised loop leaves a scalar tail; the values are equal.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

constexpr int64_t kGrain = 16;  // rows per parallel task at the least

// The float value of an element (exact for every dtype served).
inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) {
  uint32_t u = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float widen(c10::Half v) { return static_cast<float>(v); }

// float to the element dtype, rounding to nearest even (c10's conversions; bfloat16 written out so that the loop
// vectorises: NaN becomes the canonical quiet NaN, as c10 makes it).
inline float narrow(float f, float*) { return f; }
inline c10::BFloat16 narrow(float f, c10::BFloat16*) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint16_t bits = f != f ? 0x7FC0 : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return c10::BFloat16(bits, c10::BFloat16::from_bits());
}
inline c10::Half narrow(float f, c10::Half*) { return static_cast<c10::Half>(f); }

// Round half to even, as torch.round (nearbyint in the default rounding mode): below 2^23 in magnitude, adding and
// taking off 2^23 rounds the fraction away in float32 arithmetic; at or above it a float is already whole.
inline float round_even(float v) {
  const float a = std::fabs(v);
  return a < 8388608.0f ? std::copysign((a + 8388608.0f) - 8388608.0f, v) : v;
}

// One row's min and max; NaN wherever the row holds one (as torch.amin / amax give).
template <typename T>
void row_minmax(const T* x, int64_t n, float* lo, float* hi) {
  float mn = std::numeric_limits<float>::infinity(), mx = -std::numeric_limits<float>::infinity();
  int nan = 0;
#pragma omp simd reduction(min : mn) reduction(max : mx) reduction(| : nan)
  for (int64_t j = 0; j < n; ++j) {
    const float v = widen(x[j]);
    nan |= v != v;
    mn = v < mn ? v : mn;
    mx = v > mx ? v : mx;
  }
  if (nan) mn = mx = std::numeric_limits<float>::quiet_NaN();
  *lo = mn;
  *hi = mx;
}

template <typename T>
std::vector<at::Tensor> minmax_rows_impl(const at::Tensor& x) {
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  auto shape = x.sizes().vec();
  shape.back() = 1;
  auto lo = at::empty(shape, x.options()), hi = at::empty(shape, x.options());
  auto lof = at::empty({rows}, x.options().dtype(at::kFloat)), hif = at::empty({rows}, x.options().dtype(at::kFloat));
  const T* px = x.data_ptr<T>();
  float *pl = lof.data_ptr<float>(), *ph = hif.data_ptr<float>();
  at::parallel_for(0, rows, kGrain, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) row_minmax(px + i * n, n, pl + i, ph + i);
  });
  lo.copy_(lof.view(shape));  // exact: a min or max of T values is a T value
  hi.copy_(hif.view(shape));
  return {lo, hi};
}

// torch.clamp's vectorised order: the larger of (v, lo), the bound where they are equal, then the smaller of that
// and hi; NaN kept.
inline float clamp_keep_nan(float v, float lo, float hi) {
  if (v != v) return v;
  const float m = v > lo ? v : lo;
  return m < hi ? m : hi;
}

// mode 0: one scale for the whole tensor; 1: one per row (of the last dim); 2: one per channel (of the last dim)
template <typename T>
at::Tensor fake_int_impl(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& recip,
                         const at::Tensor& zero, int64_t qmin, int64_t qmax, int64_t mode) {
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  auto y = at::empty_like(x);
  const T* px = x.data_ptr<T>();
  T* py = y.data_ptr<T>();
  const float *ps = scale.data_ptr<float>(), *pr = recip.data_ptr<float>(), *pz = zero.data_ptr<float>();
  const float fmin = static_cast<float>(qmin), fmax = static_cast<float>(qmax);
  at::parallel_for(0, rows, kGrain, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      const T* xr = px + i * n;
      T* yr = py + i * n;
      if (mode == 2) {
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) {
          const float q = clamp_keep_nan(round_even(widen(xr[j]) * pr[j]), fmin - pz[j], fmax - pz[j]);
          yr[j] = narrow(q * ps[j], static_cast<T*>(nullptr));
        }
      } else {
        const int64_t k = mode == 1 ? i : 0;
        const float s = ps[k], r = pr[k], lo = fmin - pz[k], hi = fmax - pz[k];
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) {
          const float q = clamp_keep_nan(round_even(widen(xr[j]) * r), lo, hi);
          yr[j] = narrow(q * s, static_cast<T*>(nullptr));
        }
      }
    }
  });
  return y;
}

void check(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "quantgate fused kernels run on the CPU, got a tensor on ", x.device());
  TORCH_CHECK(x.is_contiguous(), "quantgate fused kernels take contiguous tensors");
  TORCH_CHECK(x.dim() >= 1, "quantgate fused kernels take tensors of one dimension or more");
}

}  // namespace

// (lo, hi): each row's (last dim's) min and max, shaped x.shape[:-1] + (1,), in x's dtype.
std::vector<at::Tensor> minmax_rows(const at::Tensor& x) {
  check(x);
  switch (x.scalar_type()) {
    case at::kFloat: return minmax_rows_impl<float>(x);
    case at::kBFloat16: return minmax_rows_impl<c10::BFloat16>(x);
    case at::kHalf: return minmax_rows_impl<c10::Half>(x);
    default: TORCH_CHECK(false, "quantgate fused kernels take float32, bfloat16 or float16, got ", x.scalar_type());
  }
}

// The integer round trip of x with float32 scale, its reciprocal and the rounded zero point (contiguous; one
// value, one per row, or one per channel of the last dim: ``mode``); values in x's dtype.
at::Tensor fake_int(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& recip, const at::Tensor& zero,
                    int64_t qmin, int64_t qmax, int64_t mode) {
  check(x);
  for (const auto* t : {&scale, &recip, &zero}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "scale, reciprocal and zero: float32, contiguous");
  }
  const int64_t n = x.size(-1), want = mode == 0 ? 1 : (mode == 1 ? (n ? x.numel() / n : 0) : n);
  TORCH_CHECK(scale.numel() == want && recip.numel() == want && zero.numel() == want, "scale shape for mode ", mode);
  switch (x.scalar_type()) {
    case at::kFloat: return fake_int_impl<float>(x, scale, recip, zero, qmin, qmax, mode);
    case at::kBFloat16: return fake_int_impl<c10::BFloat16>(x, scale, recip, zero, qmin, qmax, mode);
    case at::kHalf: return fake_int_impl<c10::Half>(x, scale, recip, zero, qmin, qmax, mode);
    default: TORCH_CHECK(false, "quantgate fused kernels take float32, bfloat16 or float16, got ", x.scalar_type());
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("minmax_rows", &minmax_rows, "each row's min and max");
  m.def("fake_int", &fake_int, "integer fake-quantization in one pass");
}
