"""Linear layers at decode batch sizes through a C++/OpenMP kernel that streams the weights once.

Two uses, both where measured to win (benchmarks/RESULTS.md, issue 26 sixth and seventh rounds):
- bfloat16 on x86 CPUs without native bf16 (oneDNN's bf16 path wants AVX-512 BW/VL/DQ or
  AVX-NE-CONVERT): oneDNN cannot pack bf16 weights there (cpu_linear.py) and PyTorch's bf16
  matmul converts element by element, ~3 GB/s. At every batch size: 1.3x PyTorch at 2 rows,
  4x at 64. A batch-1 step of the 135M model went from 100 to 82 ms.
- float32 at up to GEMV_ROWS rows (a decode batch) on AVX2 CPUs without AVX-512: oneDNN's packed
  inner product streamed the weights at 9-13 GB/s at batch 1, this kernel at 13-19 GB/s (the
  machine reads 16 GB/s). Past a few rows oneDNN's blocking wins; it keeps those.

The kernel streams four weight rows side by side (independent loads keep the memory system
busy), converts bf16 to float 8 values at a time (a 16-bit shift), and takes the input rows in
pairs against them with FMAs in float: y[m, n] = x[m] . W[n] + b[n], rounded to the dtype once.
A row's result never depends on the other rows (batch-invariant, unlike a blocked GEMM).

`torch.ops.dpserve_gemv.linear(x, weights, biases)` for x [..., K] and weights [N_i, K] is
torch.cat([F.linear(x, w_i, b_i)], -1) in one call: a fused q/k/v or gate/up group
(cpu_linear.fuse_groups) reads its members' own weights, no concatenated copy. Work is split over
output features with ATen's parallel_for. Built once per machine like the attention kernel
(compile_cache.load_op_library: -march=native, under the compile cache dir). Must never change
what a layer computes beyond float accumulation order.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

log = logging.getLogger(__name__)

NAME = "dpserve_gemv"
# Set to 0 to keep PyTorch's and oneDNN's linears everywhere.
ENV_SWITCH = "DPSERVE_CPU_GEMV"
# float32 calls of at most this many rows take the kernel; default 4 on AVX2 CPUs without AVX-512
# (measured there), 0 (never) on others until measured there.
ROWS_ENV = "DPSERVE_CPU_GEMV_ROWS"
MEASURED_ROWS = 4

SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <algorithm>
#include <optional>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

inline void to_float(const c10::BFloat16* src, float* dst, int64_t K) {
  int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; k + 8 <= K; k += 8) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k));
    _mm256_storeu_ps(dst + k, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
  }
#endif
  for (; k < K; ++k) dst[k] = static_cast<float>(src[k]);
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const c10::BFloat16* src) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))), 16));
}

inline __m256 load8(const float* src) { return _mm256_loadu_ps(src); }

inline float reduce_add(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// acc[r * MR + m] = x[m] . W[r] for the input rows m < MR: R weight rows streamed side by side, each
// 8 columns loaded (and converted) once for the MR input rows, R x MR float accumulators.
template <typename W, int R, int MR>
inline void tile(const float* xf, const W* w, int64_t K, float* acc) {
  int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 a[R][MR];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MR; ++m) a[r][m] = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    __m256 xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = _mm256_loadu_ps(xf + m * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = load8(w + r * K + k);
      for (int m = 0; m < MR; ++m) a[r][m] = _mm256_fmadd_ps(wv, xv[m], a[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MR; ++m) acc[r * MR + m] = reduce_add(a[r][m]);
#else
  for (int i = 0; i < R * MR; ++i) acc[i] = 0.f;
#endif
  for (; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MR; ++m) acc[r * MR + m] += xf[m * K + k] * static_cast<float>(w[r * K + k]);
}

// out[m, r] (r < R, m < M; rows ldo apart) = x[m] . W[r] + bias[r], input rows in pairs.
template <typename W, int R>
inline void rows(const float* xf, const W* w, const W* bias, int64_t M, int64_t K, int64_t ldo, W* out) {
  float acc[R * 2];
  for (int64_t m = 0; m < M; m += 2) {
    const int64_t mr = M - m >= 2 ? 2 : 1;
    if (mr == 2) tile<W, R, 2>(xf + m * K, w, K, acc); else tile<W, R, 1>(xf + m * K, w, K, acc);
    for (int r = 0; r < R; ++r) {
      const float add = bias ? static_cast<float>(bias[r]) : 0.f;
      for (int64_t i = 0; i < mr; ++i) out[(m + i) * ldo + r] = W(acc[r * mr + i] + add);
    }
  }
}

template <typename W>
void run(const at::Tensor& x2, const std::vector<at::Tensor>& ws, const std::vector<at::Tensor>& bs,
         const std::vector<int64_t>& start, at::Tensor& out) {
  const int64_t M = x2.size(0), K = x2.size(1), ldo = out.size(-1);
  std::vector<float> converted;
  const float* xf;
  if constexpr (std::is_same_v<W, float>) {
    xf = x2.data_ptr<float>();
  } else {
    converted.resize(M * K);
    for (int64_t m = 0; m < M; ++m) to_float(x2.data_ptr<W>() + m * K, converted.data() + m * K, K);
    xf = converted.data();
  }
  W* op = out.data_ptr<W>();
  at::parallel_for(0, ldo, 64, [&](int64_t begin, int64_t end) {
    for (size_t j = 0; j < ws.size(); ++j) {  // the members overlapping [begin, end)
      const int64_t lo = std::max(begin, start[j]), hi = std::min(end, start[j + 1]);
      const W* w = ws[j].data_ptr<W>();
      const W* b = bs[j].defined() ? bs[j].data_ptr<W>() : nullptr;
      int64_t n = lo;
      for (; n + 4 <= hi; n += 4)
        rows<W, 4>(xf, w + (n - start[j]) * K, b ? b + n - start[j] : nullptr, M, K, ldo, op + n);
      for (; n < hi; ++n)
        rows<W, 1>(xf, w + (n - start[j]) * K, b ? b + n - start[j] : nullptr, M, K, ldo, op + n);
    }
  });
}

at::Tensor linear(const at::Tensor& x, at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "gemv linear: bfloat16 or float32 input");
  TORCH_CHECK(!weights.empty() && biases.size() == weights.size(), "gemv linear: one bias (or None) per weight");
  const int64_t K = x.size(-1);
  std::vector<at::Tensor> ws, bs;
  std::vector<int64_t> start{0};
  for (size_t j = 0; j < weights.size(); ++j) {
    const at::Tensor& w = weights[j];
    TORCH_CHECK(w.scalar_type() == dtype && w.dim() == 2 && w.is_contiguous() && w.size(1) == K,
                "gemv linear: weight [N, K] contiguous, of the input's dtype and K");
    ws.push_back(w);
    const std::optional<at::Tensor> b = biases.get(j);
    if (b.has_value() && b->defined()) {
      TORCH_CHECK(b->scalar_type() == dtype && b->numel() == w.size(0), "gemv linear: bias [N] of the input's dtype");
      bs.push_back(b->contiguous());
    } else {
      bs.emplace_back();
    }
    start.push_back(start.back() + w.size(0));
  }
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = start.back();
  at::Tensor out = at::empty(shape, x.options());
  if (dtype == at::kFloat) run<float>(x2, ws, bs, start, out); else run<c10::BFloat16>(x2, ws, bs, start, out);
  return out;
}

}  // namespace

TORCH_LIBRARY(dpserve_gemv, m) { m.def("linear(Tensor x, Tensor[] weights, Tensor?[] biases) -> Tensor"); }

TORCH_LIBRARY_IMPL(dpserve_gemv, CPU, m) { m.impl("linear", &linear); }
"""

_lock = threading.Lock()
_state: dict[str, bool] = {}


def load(cache_dir: str | None = None) -> bool:
    """Build (once per machine) and register the kernel; False, logged once, when it cannot be had."""
    with _lock:
        if "loaded" not in _state:
            _state["loaded"] = _load(cache_dir)
        return _state["loaded"]


def float32_rows() -> int:
    """Up to how many rows a float32 linear takes the kernel here (0: never): ROWS_ENV when set,
    else MEASURED_ROWS on an x86 CPU with AVX2 and FMA but no AVX-512, where it was measured."""
    env = os.environ.get(ROWS_ENV, "").strip()
    if env:
        return max(0, int(env)) if env.isdigit() else 0
    flags = _cpu_flags()
    return MEASURED_ROWS if {"avx2", "fma"} <= flags and "avx512f" not in flags else 0


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _load(cache_dir: str | None) -> bool:
    from dpserve.engine.compile_cache import load_op_library

    registered = hasattr(torch.ops.dpserve_gemv, "linear")
    if not load_op_library(NAME, SOURCE, ENV_SWITCH, "linears stay on PyTorch's and oneDNN's paths", cache_dir, registered):
        return False
    if registered:
        return True

    @torch.library.register_fake("dpserve_gemv::linear")
    def _(x, weights, biases):
        return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))

    return True
