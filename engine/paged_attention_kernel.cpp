// The paged-attention decode kernel of engine/paged_attention_kernel.py (which builds it with
// torch.utils.cpp_extension, -O3 -march=native -fopenmp, and documents what it computes).
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

constexpr int64_t LANES = 16;

template <typename T>
inline void load_row(const T* src, float* dst, int64_t D) {
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) dst[d] = to_float(src[d]);
}

#ifdef __AVX512F__
// bfloat16 -> float is a 16-bit shift: 16 of them per instruction (the generic conversion is scalar).
template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t D) {
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d));
    _mm512_storeu_ps(dst + d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
  }
  for (; d < D; ++d) dst[d] = static_cast<float>(src[d]);
}

inline float dot(const float* a, const float* b, int64_t D) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + d + 16), _mm512_loadu_ps(b + d + 16), acc1);
  }
  for (; d + 16 <= D; d += 16) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc0);
  float tail = 0.f;
  for (; d < D; ++d) tail += a[d] * b[d];
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) + tail;
}

// exp(x) for x <= 0 (softmax after subtracting the max): 2^n * p(r), r = x - n ln 2, |r| <= ln2 / 2,
// p the degree-6 Taylor polynomial (relative error ~1e-7, about an ulp).
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// s[0..n) = softmax(s[0..n)), in place.
inline void softmax(float* s, int64_t n) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + i));
  if (i < n) vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(vmax, (__mmask16)((1u << (n - i)) - 1), s + i));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
  __m512 vsum = _mm512_setzero_ps();
  for (i = 0; i + 16 <= n; i += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + i), m));
    _mm512_storeu_ps(s + i, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  if (i < n) {
    const __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(k, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), m)));
    _mm512_mask_storeu_ps(s + i, k, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(vsum));
  for (i = 0; i + 16 <= n; i += 16) _mm512_storeu_ps(s + i, _mm512_mul_ps(_mm512_loadu_ps(s + i), inv));
  if (i < n) {
    const __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(s + i, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + i), inv));
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// The same paths, 8 lanes wide, for CPUs without AVX-512 (AVX2 + FMA: most AMD EPYC before Zen 4, Intel
// client cores): on such a CPU the generic code below was 2.5-5x inductor's, this another ~2x (RESULTS).
template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t D) {
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d));
    _mm256_storeu_ps(dst + d, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
  }
  for (; d < D; ++d) dst[d] = static_cast<float>(src[d]);
}

#ifdef __F16C__
template <>
inline void load_row<c10::Half>(const c10::Half* src, float* dst, int64_t D) {
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d))));
  for (; d < D; ++d) dst[d] = static_cast<float>(src[d]);
}
#endif

inline float reduce_add(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float reduce_max(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

inline float dot(const float* a, const float* b, int64_t D) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), acc1);
  }
  for (; d + 8 <= D; d += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
  float tail = 0.f;
  for (; d < D; ++d) tail += a[d] * b[d];
  return reduce_add(_mm256_add_ps(acc0, acc1)) + tail;
}

// exp(x) for x <= 0, as the AVX-512 path computes it; 2^n is built in the exponent bits (no scalef here).
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 720.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  // n is in [-126, 0] (x >= -87): 2^n = (n + 127) << 23, a normal float
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

inline void softmax(float* s, int64_t n) {
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + i));
  float m = reduce_max(vmax);
  for (; i < n; ++i) m = std::max(m, s[i]);
  const __m256 vm = _mm256_set1_ps(m);
  __m256 vsum = _mm256_setzero_ps();
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
    _mm256_storeu_ps(s + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = reduce_add(vsum);
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  const float inv = 1.f / sum;
  const __m256 vinv = _mm256_set1_ps(inv);
  for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(s + i, _mm256_mul_ps(_mm256_loadu_ps(s + i), vinv));
  for (; i < n; ++i) s[i] *= inv;
}
#else
// sum(a[d] * b[d]) over D: LANES independent partial sums (one vector register), then a tree.
inline float dot(const float* a, const float* b, int64_t D) {
  float part[LANES] = {0.f};
  int64_t d = 0;
  for (; d + LANES <= D; d += LANES)
#pragma omp simd
    for (int64_t l = 0; l < LANES; ++l) part[l] += a[d + l] * b[d + l];
  for (; d < D; ++d) part[0] += a[d] * b[d];
  for (int64_t step = LANES / 2; step > 0; step /= 2)
    for (int64_t l = 0; l < step; ++l) part[l] += part[l + step];
  return part[0];
}

inline void softmax(float* s, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) m = std::max(m, s[i]);
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  const float inv = 1.f / sum;
  for (int64_t i = 0; i < n; ++i) s[i] *= inv;
}
#endif

// One row (sequence): scores of all H = KVH * G query heads over positions [first, last), then the
// softmax-weighted sum of values. q, out: [H, D] contiguous; a slot's K/V row, [KVH, D], at kc + slot * KVH * D.
// A row of the cache is read once, whole and in order (a block's slots are contiguous), and each KV
// head's part is converted to float once for its G query heads (grouped-query attention). Scores are
// kept per head ([H, n]), so each head's softmax runs over contiguous memory.
template <typename T>
void attend(const T* q, T* out, const T* kc, const T* vc, const int64_t* table, int64_t first, int64_t last,
            int64_t bs, int64_t KVH, int64_t G, int64_t D, float scale, std::vector<float>& buf) {
  const int64_t n = last - first, H = KVH * G, stride = KVH * D;
  if (n <= 0) {
    for (int64_t i = 0; i < H * D; ++i) out[i] = T(0.f);
    return;
  }
  buf.assign(2 * H * D + D + n * H, 0.f);
  float* qf = buf.data();
  float* acc = qf + H * D;
  float* row = acc + H * D;
  float* scores = row + D;  // [H, n]
  for (int64_t i = 0; i < H * D; ++i) qf[i] = to_float(q[i]) * scale;
  for (int64_t t = first; t < last;) {  // block by block: t .. end share table[t / bs]
    const int64_t base = table[t / bs] * bs, end = std::min(last, (t / bs + 1) * bs);
    for (; t < end; ++t) {
      const T* k = kc + (base + t % bs) * stride;
      for (int64_t h = 0; h < KVH; ++h) {
        load_row(k + h * D, row, D);
        for (int64_t g = 0; g < G; ++g) scores[(h * G + g) * n + (t - first)] = dot(qf + (h * G + g) * D, row, D);
      }
    }
  }
  for (int64_t j = 0; j < H; ++j) softmax(scores + j * n, n);
  for (int64_t t = first; t < last;) {
    const int64_t base = table[t / bs] * bs, end = std::min(last, (t / bs + 1) * bs);
    for (; t < end; ++t) {
      const T* v = vc + (base + t % bs) * stride;
      for (int64_t h = 0; h < KVH; ++h) {
        load_row(v + h * D, row, D);
        for (int64_t g = 0; g < G; ++g) {
          const float w = scores[(h * G + g) * n + (t - first)];
          float* a = acc + (h * G + g) * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += w * row[d];
        }
      }
    }
  }
  for (int64_t i = 0; i < H * D; ++i) out[i] = T(acc[i]);
}

#ifdef __AVX512F__
// The AVX-512 path for head sizes of 32, 64 or 128 (DV = D / 16 vectors a row): what attend() computes,
// its accumulators in registers. Scores: 16 positions of one query head at a time, each a vector of
// partial sums, added across in one transposing tree (sum16) rather than one reduction a position.
// With AVX512_BF16, bf16 keys multiply the raw bf16 query in pairs (vdpbf16ps: exact products, float
// sums) and the scale comes after; otherwise the keys go through float. Values: a KV head's row is
// converted once and added into the accumulators of up to 16 / DV of its query heads at once.
// Measured on a 2-core EPYC (avx512_bf16), 16 rows x 100 positions, 9/3 heads of 64, bf16, one thread:
// 323 -> 105 us a call (one thread; 208 -> 46 us on two), RESULTS (issue 26, eleventh round).

// 16 lanes of a cache row as floats.
inline __m512 x16(const float* s) { return _mm512_loadu_ps(s); }
inline __m512 x16(const c10::BFloat16* s) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s))), 16));
}
inline __m512 x16(const c10::Half* s) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s))); }

template <typename T, int DV>
inline void load_vec(const T* s, __m512* o) {
  for (int c = 0; c < DV; ++c) o[c] = x16(s + 16 * c);
}

// Lane j of the result = the sum of v[j]'s 16 lanes (v is overwritten).
inline __m512 sum16(__m512* v) {
  for (int i = 0; i < 8; ++i)  // 256-bit halves: lanes 0-1 of v[i] | lanes 2-3 of v[i + 8], each a partial sum
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit lanes: v[i], v[i + 8], v[i + 4], v[i + 12]
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 4], 0x88), _mm512_shuffle_f32x4(v[i], v[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)
    v[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[i], v[i + 2]), _mm512_unpackhi_ps(v[i], v[i + 2]));
  const __m512 z = _mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
  return _mm512_shuffle_f32x4(z, z, 0xD8);  // 128-bit lanes held sums 0-3, 8-11, 4-7, 12-15
}

// scores[g * n + (t - first)] for the G query heads of KV head h (qh: their scaled float queries, [G, D];
// qraw: the same unscaled in T), over positions [first, last); kf: 16 * D floats of scratch.
template <typename T, int DV>
void scores_avx512(const float* qh, const T* qraw, const T* kc, const int64_t* table, int64_t first, int64_t last,
                   int64_t bs, int64_t stride, int64_t G, float scale, float* scores, int64_t n, float* kf) {
  constexpr int64_t D = 16 * DV;
  const T* rows[16];
  for (int64_t t0 = first; t0 < last; t0 += 16) {
    const int64_t m = std::min<int64_t>(16, last - t0);
    for (int64_t j = 0; j < m; ++j) rows[j] = kc + (table[(t0 + j) / bs] * bs + (t0 + j) % bs) * stride;
    const __mmask16 keep = static_cast<__mmask16>((1u << m) - 1);
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, c10::BFloat16> && DV % 2 == 0) {
      (void)qh;
      (void)kf;
      for (int64_t g = 0; g < G; ++g) {
        __m512i q[DV / 2];
        for (int c = 0; c < DV / 2; ++c) q[c] = _mm512_loadu_si512(qraw + g * D + 32 * c);
        __m512 acc[16];
        for (int j = 0; j < 16; ++j) {
          acc[j] = _mm512_setzero_ps();
          if (j < m)
            for (int c = 0; c < DV / 2; ++c)
              acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)q[c], (__m512bh)_mm512_loadu_si512(rows[j] + 32 * c));
        }
        _mm512_mask_storeu_ps(scores + g * n + (t0 - first), keep, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
      }
      continue;
    }
#endif
    (void)qraw;
    const float* kr[16];
    for (int64_t j = 0; j < m; ++j) {
      if constexpr (std::is_same_v<T, float>) {
        kr[j] = rows[j];
      } else {
        __m512 r[DV];
        load_vec<T, DV>(rows[j], r);
        for (int c = 0; c < DV; ++c) _mm512_storeu_ps(kf + j * D + 16 * c, r[c]);
        kr[j] = kf + j * D;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      __m512 q[DV];
      for (int c = 0; c < DV; ++c) q[c] = _mm512_loadu_ps(qh + g * D + 16 * c);
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) {
        acc[j] = _mm512_setzero_ps();
        if (j < m)
          for (int c = 0; c < DV; ++c) acc[j] = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(kr[j] + 16 * c), acc[j]);
      }
      _mm512_mask_storeu_ps(scores + g * n + (t0 - first), keep, sum16(acc));
    }
  }
}

// acc[g * D ..] = sum over t of w[g][t] * value row t of KV head h, for its G query heads (w: [G, n]).
template <typename T, int DV>
void values_avx512(const T* vc, const int64_t* table, int64_t first, int64_t last, int64_t bs, int64_t stride,
                   int64_t G, const float* w, int64_t n, float* acc_out) {
  constexpr int64_t D = 16 * DV;
  constexpr int GC = 16 / DV;  // query heads a pass: GC * DV accumulators (16 registers)
  for (int64_t g0 = 0; g0 < G; g0 += GC) {
    const int64_t gn = std::min<int64_t>(GC, G - g0);
    __m512 acc[GC][DV];
    for (int g = 0; g < GC; ++g)
      for (int c = 0; c < DV; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t t = first; t < last; ++t) {
      __m512 r[DV];
      load_vec<T, DV>(vc + (table[t / bs] * bs + t % bs) * stride, r);
      for (int g = 0; g < GC; ++g) {
        if (g < gn) {
          const __m512 wt = _mm512_set1_ps(w[(g0 + g) * n + (t - first)]);
          for (int c = 0; c < DV; ++c) acc[g][c] = _mm512_fmadd_ps(wt, r[c], acc[g][c]);
        }
      }
    }
    for (int g = 0; g < GC; ++g)
      if (g < gn)
        for (int c = 0; c < DV; ++c) _mm512_storeu_ps(acc_out + (g0 + g) * D + 16 * c, acc[g][c]);
  }
}

template <typename T, int DV>
void attend_avx512(const T* q, T* out, const T* kc, const T* vc, const int64_t* table, int64_t first, int64_t last,
                   int64_t bs, int64_t KVH, int64_t G, float scale, std::vector<float>& buf) {
  constexpr int64_t D = 16 * DV;
  const int64_t n = last - first, H = KVH * G, stride = KVH * D;
  if (n <= 0) {
    for (int64_t i = 0; i < H * D; ++i) out[i] = T(0.f);
    return;
  }
  if (static_cast<int64_t>(buf.size()) < 2 * H * D + 16 * D + H * n) buf.resize(2 * H * D + 16 * D + H * n);
  float* qf = buf.data();
  float* acc = qf + H * D;
  float* kf = acc + H * D;
  float* scores = kf + 16 * D;  // [H, n]
  for (int64_t i = 0; i < H * D; ++i) qf[i] = to_float(q[i]) * scale;
  for (int64_t h = 0; h < KVH; ++h)
    scores_avx512<T, DV>(qf + h * G * D, q + h * G * D, kc + h * D, table, first, last, bs, stride, G, scale,
                         scores + h * G * n, n, kf);
  for (int64_t j = 0; j < H; ++j) softmax(scores + j * n, n);
  for (int64_t h = 0; h < KVH; ++h)
    values_avx512<T, DV>(vc + h * D, table, first, last, bs, stride, G, scores + h * G * n, n, acc + h * G * D);
  for (int64_t i = 0; i < H * D; ++i) out[i] = T(acc[i]);
}

// The AVX-512 path when the head size has one (false: the caller runs attend()).
template <typename T>
bool attend_fast(const T* q, T* out, const T* kc, const T* vc, const int64_t* table, int64_t first, int64_t last,
                 int64_t bs, int64_t KVH, int64_t G, int64_t D, float scale, std::vector<float>& buf) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>) {
    switch (D) {
      case 32: attend_avx512<T, 2>(q, out, kc, vc, table, first, last, bs, KVH, G, scale, buf); return true;
      case 64: attend_avx512<T, 4>(q, out, kc, vc, table, first, last, bs, KVH, G, scale, buf); return true;
      case 128: attend_avx512<T, 8>(q, out, kc, vc, table, first, last, bs, KVH, G, scale, buf); return true;
      default: return false;
    }
  }
  return false;  // float64
}
#else
template <typename T>
bool attend_fast(const T*, T*, const T*, const T*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                 int64_t, float, std::vector<float>&) {
  return false;
}
#endif

at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& lengths, int64_t block_size,
                        double scale, int64_t window) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode: query [B, H, D], caches [slots, KVH, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode: caches must be contiguous");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_decode: query and caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong,
              "paged_decode: block_tables and lengths must be int64");
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2), KVH = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D && H % KVH == 0, "paged_decode: head shapes do not match");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && lengths.numel() == B,
              "paged_decode: block_tables [B, W] and lengths [B]");
  const int64_t G = H / KVH, W = block_tables.size(1);
  const at::Tensor q = query.contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = lengths.contiguous();
  at::Tensor out = at::empty({B, H, D}, query.options());
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lp[b] >= 0 && lp[b] <= W * block_size, "paged_decode: a length exceeds its block table");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf;
      for (int64_t b = begin; b < end; ++b) {
        const int64_t len = lp[b], first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
        if (!attend_fast<scalar_t>(qp + b * H * D, op + b * H * D, kp, vp, tp + b * W, first, len, block_size, KVH,
                                   G, D, static_cast<float>(scale), buf))
          attend<scalar_t>(qp + b * H * D, op + b * H * D, kp, vp, tp + b * W, first, len, block_size, KVH, G, D,
                           static_cast<float>(scale), buf);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(dpserve_kernels, m) {
  m.def("paged_decode(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor lengths, "
        "int block_size, float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(dpserve_kernels, CPU, m) { m.impl("paged_decode", &paged_decode); }
