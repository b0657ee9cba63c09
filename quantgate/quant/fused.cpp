// quantgate's fused CPU kernels (quantgate/quant/fused.py builds and loads them, and says what each serves).
//
// Each kernel does in one or two passes over a tensor what the eager reference (quantizers.fake_int,
// minifloat.fake_minifloat / fake_mx / nvfp4, ActQuant's per-token ranges, observe.TensorStats) does in six to
// twenty, with the same float32 operations in the same order, so that the results are bit-identical to it: x widened
// to float32 (exact), q = x * r (r = 1 / scale), rounded half to even, clamped to [qmin - z, qmax - z] (NaN kept, as
// torch.clamp keeps it), times the scale, rounded back to x's dtype (round to nearest even, c10's conversion); the
// small float formats divide by the scale and round on the grid's step, as minifloat.round_ does. Built with
// -ffp-contract=off: no multiply-add is fused, each operation rounds as torch's does. Bit-identical but for the
// sign of a zero where a rounded -0.0 meets a bound of 0 (asymmetric ranges): torch's own clamp gives either sign
// there, depending on where its vectorised loop leaves a scalar tail; the values are equal. observe's moments are
// the exception: the same float32 terms summed in float64, not in torch's float32 order.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <atomic>
#include <limits>
#include <mutex>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kGrain = 16;  // rows per parallel task at the least
constexpr int64_t kPart = 64;  // values per float32 partial sum of observe's statistics (then float64)

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

// One row's integer round trip with one scale s, its reciprocal r and bounds [lo, hi] (qmin - z, qmax - z).
template <typename T>
inline void round_trip_row(const T* xr, T* yr, int64_t n, float s, float r, float lo, float hi) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float q = clamp_keep_nan(round_even(widen(xr[j]) * r), lo, hi);
    yr[j] = narrow(q * s, static_cast<T*>(nullptr));
  }
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
        round_trip_row(xr, yr, n, ps[k], pr[k], fmin - pz[k], fmax - pz[k]);
      }
    }
  });
  return y;
}

// Dynamic per-row integer fake quantization in one call: each row's range (row_minmax), its scale and zero point by
// torchao's choose_qparams_affine_with_min_max (float32: min(lo, 0) and max(hi, 0); symmetric: the larger magnitude
// over (qmax - qmin) / 2, zero point 0; asymmetric: the span over qmax - qmin, zero point qmin - round(min / scale)
// clamped to the grid; scales at least eps), then fake_int_impl's round trip of the row.
template <typename T>
at::Tensor fake_int_rows_impl(const at::Tensor& x, int64_t qmin, int64_t qmax, bool symmetric, double eps) {
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  auto y = at::empty_like(x);
  const T* px = x.data_ptr<T>();
  T* py = y.data_ptr<T>();
  const float fmin = static_cast<float>(qmin), fmax = static_cast<float>(qmax), feps = static_cast<float>(eps);
  const float half_span = static_cast<float>((qmax - qmin) / 2.0), span = static_cast<float>(qmax - qmin);
  at::parallel_for(0, rows, kGrain, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      const T* xr = px + i * n;
      T* yr = py + i * n;
      float lo, hi;
      row_minmax(xr, n, &lo, &hi);
      const float neg = lo != lo ? lo : (lo < 0.0f ? lo : 0.0f), pos = hi != hi ? hi : (hi > 0.0f ? hi : 0.0f);
      float scale, zero = 0.0f;
      if (symmetric) {
        const float m = neg != neg ? neg : (pos != pos ? pos : (-neg > pos ? -neg : pos));
        scale = m / half_span;
      } else {
        scale = (pos - neg) / span;
      }
      scale = scale < feps ? feps : scale;  // NaN kept
      if (!symmetric) {
        zero = clamp_keep_nan(fmin - round_even(neg / scale), fmin, fmax);
      }
      round_trip_row(xr, yr, n, scale, 1.0f / scale, fmin - zero, fmax - zero);
    }
  });
  return y;
}

// Rounding onto a small float grid (quantgate/quant/minifloat.py's round_): the step is 2^(floor(log2 |y|) - m),
// the float32 exponent field of y clamped below at the smallest normal's and less m mantissa bits, as bits; y / step
// rounded half to even, times the step (both exact powers of two). NaN and inf pass through.
inline float round_minifloat(float y, int32_t floor_bits, int32_t mant_bits) {
  uint32_t u;
  std::memcpy(&u, &y, sizeof u);
  int32_t e = static_cast<int32_t>(u & 0x7F800000u);
  e = (e < floor_bits ? floor_bits : e) - mant_bits;
  float step;
  std::memcpy(&step, &e, sizeof step);
  return round_even(y / step) * step;
}

// Small float formats: (mantissa bits, exponent of the smallest normal, largest magnitude) as minifloat.MINIFLOATS.
struct Minifloat {
  int32_t floor_bits, mant_bits;
  float fmax;
  Minifloat(int64_t mbits, int64_t emin, double fmax)
      : floor_bits(static_cast<int32_t>((emin + 127) << 23)), mant_bits(static_cast<int32_t>(mbits << 23)),
        fmax(static_cast<float>(fmax)) {}
};

// round(clamp(x / s, -fmax, fmax)) * s per element, counting |x| > fmax * s (saturated) and noting any NaN or inf
// in x; scale modes as fake_int_impl.
template <typename T>
std::tuple<at::Tensor, int64_t, bool> fake_minifloat_impl(const at::Tensor& x, const at::Tensor& scale,
                                                          const Minifloat f, int64_t mode) {
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  auto y = at::empty_like(x);
  const T* px = x.data_ptr<T>();
  T* py = y.data_ptr<T>();
  const float* ps = scale.data_ptr<float>();
  std::atomic<int64_t> saturated{0};
  std::atomic<bool> special{false};
  at::parallel_for(0, rows, kGrain, [&](int64_t a, int64_t b) {
    int64_t over = 0;
    int odd = 0;
    for (int64_t i = a; i < b; ++i) {
      const T* xr = px + i * n;
      T* yr = py + i * n;
      const int64_t k = mode == 1 ? i : 0;
      const bool per_channel = mode == 2;
#pragma omp simd reduction(+ : over) reduction(| : odd)
      for (int64_t j = 0; j < n; ++j) {
        const float s = per_channel ? ps[j] : ps[k];
        const float v = widen(xr[j]), mag = std::fabs(v);
        over += mag > f.fmax * s;
        odd |= !(mag <= std::numeric_limits<float>::max());
        const float q = round_minifloat(clamp_keep_nan(v / s, -f.fmax, f.fmax), f.floor_bits, f.mant_bits);
        yr[j] = narrow(q * s, static_cast<T*>(nullptr));
      }
    }
    saturated += over;
    if (odd) special = true;
  });
  return {y, saturated.load(), special.load()};
}

// OCP MX blocks along the last dim (minifloat.fake_mx): per block of ``block`` values, the E8M0 scale 2^e with e the
// exponent field of the block's max |x| less 127 and the element format's largest power of two, clamped to
// [-127, 127]; elements x / max(2^e, 2^-126) clamped and rounded, times 2^e (NaN for a block holding NaN).
template <typename T>
at::Tensor fake_mx_impl(const at::Tensor& x, const Minifloat f, int64_t max_pow2, int64_t block) {
  const int64_t blocks = x.numel() / block;
  auto y = at::empty_like(x);
  const T* px = x.data_ptr<T>();
  T* py = y.data_ptr<T>();
  at::parallel_for(0, blocks, kGrain, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      const T* xb = px + i * block;
      T* yb = py + i * block;
      float amax = 0.0f;
      int nan = 0;
#pragma omp simd reduction(max : amax) reduction(| : nan)
      for (int64_t j = 0; j < block; ++j) {
        const float m = std::fabs(widen(xb[j]));
        nan |= m != m;
        amax = m > amax ? m : amax;
      }
      uint32_t u;
      std::memcpy(&u, &amax, sizeof u);
      int32_t e = static_cast<int32_t>((u >> 23) & 0xFFu) - 127 - static_cast<int32_t>(max_pow2);
      e = e < -127 ? -127 : (e > 127 ? 127 : e);
      const int32_t div_bits = (e + 127 < 1 ? 1 : e + 127) << 23;
      float div;
      std::memcpy(&div, &div_bits, sizeof div);
      const float mul = nan ? std::numeric_limits<float>::quiet_NaN() : (e == -127 ? std::ldexp(1.0f, -127) : div);
#pragma omp simd
      for (int64_t j = 0; j < block; ++j) {
        const float q = round_minifloat(clamp_keep_nan(widen(xb[j]) / div, -f.fmax, f.fmax), f.floor_bits, f.mant_bits);
        yb[j] = narrow(q * mul, static_cast<T*>(nullptr));
      }
    }
  });
  return y;
}

// NVFP4 (minifloat.nvfp4): the per-tensor scale t = max |x| / (448 * 6); per block of 16 along the last dim the E4M3
// scale s = e4m3(clamp(max |x_block| / 6 / t, 2^-6, 448)); elements e2m1(x * ((1 / t) / s)), times t * s. Two passes:
// the blocks' max |x|, then the elements. Returns an undefined tensor where a scale is not finite (x all zeros, NaN,
// inf, or max |x| below ~1e-33), which the eager path hands to torchao.
template <typename T>
at::Tensor fake_nvfp4_impl(const at::Tensor& x) {
  constexpr int64_t block = 16;
  const int64_t blocks = x.numel() / block;
  const T* px = x.data_ptr<T>();
  auto amax = at::empty({blocks}, x.options().dtype(at::kFloat));
  float* pa = amax.data_ptr<float>();
  std::atomic<bool> special{false};
  at::parallel_for(0, blocks, kGrain * 16, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      const T* xb = px + i * block;
      float m = 0.0f;
      int odd = 0;
#pragma omp simd reduction(max : m) reduction(| : odd)
      for (int64_t j = 0; j < block; ++j) {
        const float v = std::fabs(widen(xb[j]));
        odd |= !(v <= std::numeric_limits<float>::max());
        m = v > m ? v : m;
      }
      pa[i] = m;
      if (odd) special = true;
    }
  });
  if (special.load()) return at::Tensor();
  float largest = 0.0f;
  for (int64_t i = 0; i < blocks; ++i) largest = pa[i] > largest ? pa[i] : largest;
  const float t = largest / (448.0f * 6.0f), recip_t = 1.0f / t;
  const Minifloat e4m3(3, -6, 448.0), e2m1(1, 0, 6.0);
  auto y = at::empty_like(x);
  T* py = y.data_ptr<T>();
  at::parallel_for(0, blocks, kGrain * 16, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      const float s = round_minifloat(clamp_keep_nan(pa[i] / 6.0f / t, 0.015625f, 448.0f), e4m3.floor_bits,
                                      e4m3.mant_bits);
      const float recip = recip_t / s, back = t * s;
      if (!(std::fabs(recip) <= std::numeric_limits<float>::max())) {
        special = true;
        return;
      }
      const T* xb = px + i * block;
      T* yb = py + i * block;
#pragma omp simd
      for (int64_t j = 0; j < block; ++j) {
        yb[j] = narrow(round_minifloat(widen(xb[j]) * recip, e2m1.floor_bits, e2m1.mant_bits) * back,
                       static_cast<T*>(nullptr));
      }
    }
  });
  return special.load() || !std::isfinite(t) ? at::Tensor() : y;
}

// observe's per-tensor statistics of an unpadded (b, t, c) tensor (observe.TensorStats._update_whole), in two passes:
// each token's largest |x| and its first channel, each sequence's largest and its first position, each channel's
// largest |x| and how often it holds a token's largest, each sequence's sum (float64); then each sequence's centred
// second and fourth moments: d = x - mean in float32, d^2 and d^4 in float32 as the eager path forms them, summed in
// float64. Returns an empty list where x holds NaN or inf (the eager path counts those).
template <typename T>
std::vector<at::Tensor> tensor_stats_impl(const at::Tensor& x) {
  const int64_t b = x.size(0), t = x.size(1), c = x.size(2), rows = b * t;
  const T* px = x.data_ptr<T>();
  auto f32 = x.options().dtype(at::kFloat), f64 = x.options().dtype(at::kDouble), i64 = x.options().dtype(at::kLong);
  auto tok_max = at::empty({rows}, f32), tok_sum = at::empty({rows}, f64);
  auto tok_arg = at::empty({rows}, i64);
  auto cmax = at::zeros({c}, f32), top = at::zeros({c}, i64);
  float *ptm = tok_max.data_ptr<float>(), *pcm = cmax.data_ptr<float>();
  double* pts = tok_sum.data_ptr<double>();
  int64_t *pta = tok_arg.data_ptr<int64_t>(), *ptop = top.data_ptr<int64_t>();
  std::atomic<bool> special{false};
  std::mutex merge;
  at::parallel_for(0, rows, kGrain, [&](int64_t a, int64_t z) {
    std::vector<float> lmax(c, 0.0f);
    std::vector<int64_t> ltop(c, 0);
    float* lm = lmax.data();
    for (int64_t i = a; i < z; ++i) {
      const T* xr = px + i * c;
      float m = 0.0f;
      double s = 0.0;
      int odd = 0;
      for (int64_t j0 = 0; j0 < c; j0 += kPart) {  // float32 partial sums of kPart values, added in float64
        const int64_t j1 = j0 + kPart < c ? j0 + kPart : c;
        float part = 0.0f;
#pragma omp simd reduction(max : m) reduction(+ : part) reduction(| : odd)
        for (int64_t j = j0; j < j1; ++j) {
          const float v = widen(xr[j]), mag = std::fabs(v);
          odd |= !(mag <= std::numeric_limits<float>::max());
          m = mag > m ? mag : m;
          part += v;
          lm[j] = mag > lm[j] ? mag : lm[j];
        }
        s += static_cast<double>(part);
      }
      if (odd) {
        special = true;
        return;
      }
      int64_t arg = c;  // the first channel holding the largest
#pragma omp simd reduction(min : arg)
      for (int64_t j = 0; j < c; ++j) {
        const int64_t here = std::fabs(widen(xr[j])) == m ? j : c;
        arg = here < arg ? here : arg;
      }
      ptm[i] = m;
      pts[i] = s;
      pta[i] = arg;
      ++ltop[arg];
    }
    std::lock_guard<std::mutex> hold(merge);
    for (int64_t j = 0; j < c; ++j) {
      pcm[j] = lmax[j] > pcm[j] ? lmax[j] : pcm[j];
      ptop[j] += ltop[j];
    }
  });
  if (special.load()) return {};
  auto seq_max = at::empty({b}, f32), m2 = at::empty({b}, f64), m4 = at::empty({b}, f64);
  auto pos = at::empty({b}, i64);
  auto mean = std::vector<float>(b);
  for (int64_t r = 0; r < b; ++r) {  // in token order: the first position of a tie, the same sum for any threads
    float best = -1.0f;
    int64_t at_pos = 0;
    double sum = 0.0;
    for (int64_t k = 0; k < t; ++k) {
      if (ptm[r * t + k] > best) best = ptm[r * t + k], at_pos = k;
      sum += pts[r * t + k];
    }
    seq_max.data_ptr<float>()[r] = best;
    pos.data_ptr<int64_t>()[r] = at_pos;
    mean[r] = static_cast<float>(sum / static_cast<double>(t * c));
  }
  auto tok_m2 = at::empty({rows}, f64), tok_m4 = at::empty({rows}, f64);
  double *p2 = tok_m2.data_ptr<double>(), *p4 = tok_m4.data_ptr<double>();
  at::parallel_for(0, rows, kGrain, [&](int64_t a, int64_t z) {
    for (int64_t i = a; i < z; ++i) {
      const T* xr = px + i * c;
      const float mu = mean[i / t];
      double s2 = 0.0, s4 = 0.0;
      for (int64_t j0 = 0; j0 < c; j0 += kPart) {
        const int64_t j1 = j0 + kPart < c ? j0 + kPart : c;
        float p2 = 0.0f, p4 = 0.0f;
#pragma omp simd reduction(+ : p2, p4)
        for (int64_t j = j0; j < j1; ++j) {
          const float d = widen(xr[j]) - mu, d2 = d * d;
          p2 += d2;
          p4 += d2 * d2;
        }
        s2 += static_cast<double>(p2);
        s4 += static_cast<double>(p4);
      }
      p2[i] = s2;
      p4[i] = s4;
    }
  });
  for (int64_t r = 0; r < b; ++r) {
    double s2 = 0.0, s4 = 0.0;
    for (int64_t k = 0; k < t; ++k) s2 += p2[r * t + k], s4 += p4[r * t + k];
    m2.data_ptr<double>()[r] = s2;
    m4.data_ptr<double>()[r] = s4;
  }
  return {seq_max, pos, top, cmax, m2, m4};
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

#define QG_DISPATCH(x, call)                                                                                   \
  switch ((x).scalar_type()) {                                                                                 \
    case at::kFloat: return call(float);                                                                       \
    case at::kBFloat16: return call(c10::BFloat16);                                                            \
    case at::kHalf: return call(c10::Half);                                                                    \
    default: TORCH_CHECK(false, "quantgate fused kernels take float32, bfloat16 or float16, got ", (x).scalar_type()); \
  }

// Dynamic per-row (last dim) integer fake quantization of x on the grid [qmin, qmax] (symmetric or not, scales at
// least eps), in x's dtype: range, scale, zero point and round trip in one call.
at::Tensor fake_int_rows(const at::Tensor& x, int64_t qmin, int64_t qmax, bool symmetric, double eps) {
  check(x);
#define QG_CALL(T) fake_int_rows_impl<T>(x, qmin, qmax, symmetric, eps)
  QG_DISPATCH(x, QG_CALL)
#undef QG_CALL
}

// The round trip of x / scale through a small float format (mbits, emin, fmax), saturating at +-fmax: (values in x's
// dtype, how many |x| > fmax * scale, whether x holds NaN or inf); scale float32, contiguous, modes as fake_int.
std::tuple<at::Tensor, int64_t, bool> fake_minifloat(const at::Tensor& x, const at::Tensor& scale, int64_t mbits,
                                                     int64_t emin, double fmax, int64_t mode) {
  check(x);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous(), "scale: float32, contiguous");
  const int64_t n = x.size(-1), want = mode == 0 ? 1 : (mode == 1 ? (n ? x.numel() / n : 0) : n);
  TORCH_CHECK(scale.numel() == want, "scale shape for mode ", mode);
  const Minifloat f(mbits, emin, fmax);
#define QG_CALL(T) fake_minifloat_impl<T>(x, scale, f, mode)
  QG_DISPATCH(x, QG_CALL)
#undef QG_CALL
}

// The OCP MX round trip of x in blocks of ``block`` along its last dim (element format mbits, emin, fmax, its largest
// power of two max_pow2); values in x's dtype.
at::Tensor fake_mx(const at::Tensor& x, int64_t mbits, int64_t emin, double fmax, int64_t max_pow2, int64_t block) {
  check(x);
  TORCH_CHECK(block > 0 && x.size(-1) % block == 0, "MX blocks of ", block, " must divide the last dim");
  const Minifloat f(mbits, emin, fmax);
#define QG_CALL(T) fake_mx_impl<T>(x, f, max_pow2, block)
  QG_DISPATCH(x, QG_CALL)
#undef QG_CALL
}

// The NVFP4 round trip of x (last dim a multiple of 16, one per-tensor scale over all of it), in x's dtype; an
// undefined tensor where a scale is not finite.
at::Tensor fake_nvfp4(const at::Tensor& x) {
  check(x);
  TORCH_CHECK(x.size(-1) % 16 == 0, "NVFP4 blocks of 16 must divide the last dim");
#define QG_CALL(T) fake_nvfp4_impl<T>(x)
  QG_DISPATCH(x, QG_CALL)
#undef QG_CALL
}

// observe's |x| histogram from log10 values ``logs`` (float32, contiguous; observe._histogram's arithmetic): each
// value clamped to at most ``top``, then bin int(((v - lo) * bins) / span) (float32 operations, truncation), at most
// bins - 1; the counts as float64. Values below lo or NaN are refused (observe clamps before the log).
at::Tensor log_bins(const at::Tensor& logs, double lo, double span, double top, int64_t bins) {
  check(logs);
  TORCH_CHECK(logs.scalar_type() == at::kFloat, "log_bins takes float32");
  const float flo = static_cast<float>(lo), fspan = static_cast<float>(span), ftop = static_cast<float>(top);
  const float fbins = static_cast<float>(bins);
  const float* pv = logs.data_ptr<float>();
  const int64_t n = logs.numel();
  std::vector<int32_t> at(n);
  int32_t* pk = at.data();
  int bad = 0;
#pragma omp simd reduction(| : bad)
  for (int64_t i = 0; i < n; ++i) {  // the bins, vectorised; then counted
    const float v = pv[i] < ftop ? pv[i] : ftop;
    const float where = ((v - flo) * fbins) / fspan;
    const bool ok = where >= 0.0f && where < 2147483520.0f;  // NaN fails
    bad |= !ok;
    const int32_t k = static_cast<int32_t>(ok ? where : 0.0f);
    pk[i] = k < bins - 1 ? k : static_cast<int32_t>(bins - 1);
  }
  TORCH_CHECK(!bad, "log_bins: a value below the histogram's range or NaN");
  std::vector<int64_t> counts(bins, 0);
  for (int64_t i = 0; i < n; ++i) ++counts[pk[i]];
  auto out = at::empty({bins}, logs.options().dtype(at::kDouble));
  double* po = out.data_ptr<double>();
  for (int64_t k = 0; k < bins; ++k) po[k] = static_cast<double>(counts[k]);
  return out;
}

// observe's statistics of a (b, t, c) tensor: [seq_max, pos, top, cmax, m2, m4], or [] where x holds NaN/inf.
std::vector<at::Tensor> tensor_stats(const at::Tensor& x) {
  check(x);
  TORCH_CHECK(x.dim() == 3 && x.numel() > 0, "tensor_stats takes a non-empty (b, t, c) tensor");
#define QG_CALL(T) tensor_stats_impl<T>(x)
  QG_DISPATCH(x, QG_CALL)
#undef QG_CALL
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("minmax_rows", &minmax_rows, "each row's min and max");
  m.def("fake_int", &fake_int, "integer fake-quantization in one pass");
  m.def("fake_int_rows", &fake_int_rows, "dynamic per-row integer fake-quantization in one call");
  m.def("fake_minifloat", &fake_minifloat, "FP8 / FP4 fake-quantization in one pass");
  m.def("fake_mx", &fake_mx, "OCP MX fake-quantization in one pass per block");
  m.def("fake_nvfp4", &fake_nvfp4, "NVFP4 fake-quantization in two passes");
  m.def("log_bins", &log_bins, "observe's log-magnitude histogram counts");
  m.def("tensor_stats", &tensor_stats, "observe's per-tensor statistics in two passes");
}
