// bfloat16 linear layers on CPUs with AVX512-BF16 (meshserve/layers/linear.py).
//
// A bfloat16 model's linears went through oneDNN, and at batch 1 its decode ran at 0.57x of the float32 model's
// rate though it reads half the bytes. Here a weight is packed once into 32-column blocks of column pairs,
// [N/32][K/2][32][2]: one vdpbf16ps multiplies a pair of input values (broadcast) with the same pair of rows of 16
// columns and adds both products to float32 accumulators, so a block streams once per tile of rows, as the float32
// kernel's does (cpu_kernels.cpp), and the output is rounded to bfloat16 once, at the end. Products of two
// bfloat16 numbers are exact in float32; only the order of the sums differs from oneDNN's.
//
// Elsewhere (no AVX512-BF16) the op is not offered (`bf16_native` says so) and the torch path serves.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "parallel_tasks.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using meshserve_kernels::parallel_tasks;
constexpr int64_t kBlockCols = 32;  // columns of one packed block

#if defined(__AVX512BF16__)
constexpr int kMaxTileRows = 12;    // 2 x 12 accumulators, 2 weight vectors and a broadcast in 32 registers
constexpr int kPrefetchPairs = 64;  // packed rows of pairs (128 bytes each) fetched ahead into L2, as cpu_kernels.cpp

// out[m, 0:32] = sum_k x[m, k] w[k, 0:32] for M rows; w is one packed block [K/2][32][2] (pairs of k).
template <int M>
void bf16_tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t pairs, uint16_t* out, int64_t ldo) {
  __m512 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* row = w + p * kBlockCols * 2;
    _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchPairs * kBlockCols * 2), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchPairs * kBlockCols * 2 + kBlockCols), _MM_HINT_T1);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(row), w1 = (__m512bh)_mm512_loadu_si512(row + kBlockCols);
#pragma GCC unroll 12
    for (int m = 0; m < M; ++m) {
      int32_t two;
      std::memcpy(&two, x + m * ldx + 2 * p, sizeof(two));
      const __m512bh xp = (__m512bh)_mm512_set1_epi32(two);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xp, w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xp, w1);
    }
  }
  for (int m = 0; m < M; ++m) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * ldo), (__m256i)_mm512_cvtneps_pbh(acc[m][0]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * ldo + 16), (__m256i)_mm512_cvtneps_pbh(acc[m][1]));
  }
}

using TileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, uint16_t*, int64_t);
template <int... Ms>
constexpr std::array<TileFn, sizeof...(Ms)> tile_table(std::integer_sequence<int, Ms...>) {
  return {&bf16_tile<Ms + 1>...};
}
constexpr auto kTiles = tile_table(std::make_integer_sequence<int, kMaxTileRows>{});
constexpr bool kNative = true;
#else
constexpr bool kNative = false;
#endif

bool bf16_native() { return kNative; }

// x [M, K] bfloat16 (rows contiguous, any row stride) through the packed weight w [N/32, K/2, 32, 2] -> [M, N]
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(kNative, "bf16_linear needs a CPU with AVX512-BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "bf16_linear takes bfloat16 tensors");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "bf16_linear: x [M, K] with contiguous rows");
  TORCH_CHECK(w.dim() == 4 && w.is_contiguous() && w.size(2) == kBlockCols && w.size(3) == 2 &&
                  w.size(1) * 2 == x.size(1),
              "bf16_linear: w [N/32, K/2, 32, 2] packed for x's K");
  const int64_t rows = x.size(0), blocks = w.size(0), pairs = w.size(1), n = blocks * kBlockCols;
  auto out = at::empty({rows, n}, x.options());
#if defined(__AVX512BF16__)
  const auto* px = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* pw = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* po = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t ldx = x.stride(0), tiles = (rows + kMaxTileRows - 1) / kMaxTileRows;
  // one task per (tile of rows, block of columns), blocks inner: a tile's rows stay in cache while the blocks stream
  parallel_tasks(tiles * blocks, [&](int64_t task) {
    const int64_t r = task / blocks * kMaxTileRows, j = task % blocks;
    const int64_t m = std::min<int64_t>(kMaxTileRows, rows - r);
    kTiles[m - 1](px + r * ldx, ldx, pw + j * pairs * kBlockCols * 2, pairs, po + r * n + j * kBlockCols, n);
  });
#endif
  return out;
}

}  // namespace

namespace meshserve_kernels {  // for the fused decode layers (decode_layer.cpp)
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w) { return ::bf16_linear(x, w); }
}  // namespace meshserve_kernels

TORCH_LIBRARY_FRAGMENT(meshserve_cpu, m) {
  m.def("bf16_linear(Tensor x, Tensor w) -> Tensor");
  m.def("bf16_native() -> bool");
}

TORCH_LIBRARY_IMPL(meshserve_cpu, CPU, m) { m.impl("bf16_linear", &bf16_linear); }
TORCH_LIBRARY_IMPL(meshserve_cpu, CatchAll, m) { m.impl("bf16_native", &bf16_native); }
