// INT8 W8A8 CPU kernels: per-output-channel symmetric int8 weights, per-token dynamic symmetric int8
// activations, int32 accumulation.
//
// * int8_linear: out = dequant(quant(x) W^T) (+ bias).
// * int8_moe_forward: one MoE layer's routed experts (grouping by expert, both matmuls, the silu * up
//   activation and its re-quantization, the weighted combine), all in one parallel region.
//
// With AVX-512 VNNI one vpdpbusd multiplies 4 unsigned bytes by 4 signed bytes in each of 16 int32 lanes,
// 64 multiply-adds per instruction against 16 for a float FMA, and the weight streams at a quarter of the
// float bytes. vpdpbusd wants one unsigned operand: activations are stored as q + 128 (1..255) and the
// excess, 128 * sum_k w[n, k], is precomputed per column at pack time (the "compensation") and starts
// each accumulator negative.
//
// Packed weight layout (int8.py `pack`): [..., N/16, G, 64] with G = ceil(K/4): block b holds columns
// [16b, 16b + 16), group g holds k in [4g, 4g + 4): byte 4c + i is w[16b + c, 4g + i] (zero past K). One
// group of one block is one 64-byte vector, the four k values of each of 16 columns: exactly vpdpbusd's
// operand against a broadcast of 4 activation bytes. A tile of up to 4 blocks x up to 12 rows keeps its
// accumulators in registers and reads each weight vector once per tile.
//
// Where the compiler targets no AVX-512 VNNI the same layout runs through plain loops (same results).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define MESHSERVE_INT8_VNNI 1
#include <immintrin.h>
#endif

namespace {

typedef float vec __attribute__((vector_size(64)));
typedef int32_t ivec __attribute__((vector_size(64)));
constexpr int kLanes = 16;              // columns per packed block: one vector of int32 accumulators
constexpr int kGroupBytes = 4 * kLanes;  // one k-group of one block
constexpr int kMaxBlocks = 4;           // column blocks per tile
constexpr int kMaxRows = 12;            // rows per tile (blocks x rows <= 24 accumulators)
constexpr int kAccStride = kMaxBlocks * kLanes;  // int32 per row of a tile's accumulator buffer
constexpr int kPrefetchGroups = 16;     // k-groups (cache lines of each block) fetched ahead
constexpr int kChunkGroups = 64;        // k-groups per chunk of tiles sharing a weight: 16 KB of 4 blocks
constexpr int kChunkTiles = 4;          // tiles per pass over such chunks
constexpr int64_t kMaxK = 65536;        // 255 * 127 * K must stay below 2^31
// Multiply-adds below which a call runs on the calling thread: waking the other threads costs more.
constexpr int64_t kSerialWork = int64_t(1) << 18;

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(vec));
  return v;
}
inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof(vec)); }
inline ivec iload(const int32_t* p) {
  ivec v;
  std::memcpy(&v, p, sizeof(ivec));
  return v;
}
inline vec splat(float s) { return vec{} + s; }
inline vec vmax(vec a, vec b) { return a > b ? a : b; }
inline vec vmin(vec a, vec b) { return a < b ? a : b; }

// exp(x) lane by lane: Cephes range reduction and polynomial (relative error ~2e-7), as cpu_kernels.cpp.
inline vec vexp(vec x) {
  x = vmin(vmax(x, splat(-87.3f)), splat(88.3f));
  vec fx = x * 1.44269504088896341f + 0.5f;
  vec tr = __builtin_convertvector(__builtin_convertvector(fx, ivec), vec);
  vec n = tr - (tr > fx ? splat(1.0f) : splat(0.0f));  // floor
  x = x - n * 0.693359375f + n * 2.12194440e-4f;
  vec y = splat(1.9875691500e-4f);
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * x * x + x + 1.0f;
  ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
  vec scale;
  std::memcpy(&scale, &bits, sizeof(vec));
  return y * scale;
}

inline void cpu_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Runs P phases of tasks, run(phase, index), in one parallel region; a phase starts once every task of the
// one before has finished. Within a phase each thread works through its own contiguous share of the tasks
// first (consecutive tasks read consecutive weight blocks, so the hardware prefetcher's streams run on
// from one task into the next), then takes what is left of the others' shares: on a machine where other
// processes take a core now and then, a delayed thread's work moves to the others instead of holding
// everyone at the end of the phase. A thread waits only for tasks already taken, which are running, so
// the waits end with any number of threads. One region instead of one per phase: waking the threads
// costs about as much as a decode-sized phase.
template <size_t P, typename Run>
void run_phases(const std::array<int64_t, P>& counts, bool parallel, const Run& run) {
  constexpr int64_t kMaxShares = 64;
  const int64_t widest = *std::max_element(counts.begin(), counts.end());
  const int64_t shares = parallel ? std::min({int64_t(at::get_num_threads()), widest, kMaxShares}) : 1;
  if (shares <= 1) {
    for (size_t p = 0; p < P; ++p)
      for (int64_t i = 0; i < counts[p]; ++i) run(p, i);
    return;
  }
  std::array<std::array<std::atomic<int64_t>, kMaxShares>, P> next;  // per phase and share: its next task
  std::array<std::atomic<int64_t>, P> done;                           // per phase: tasks finished
  for (size_t p = 0; p < P; ++p) {
    done[p].store(0, std::memory_order_relaxed);
    for (int64_t k = 0; k < shares; ++k) next[p][k].store(k * counts[p] / shares, std::memory_order_relaxed);
  }
  at::parallel_for(0, shares, 1, [&](int64_t begin, int64_t) {
    for (size_t p = 0; p < P; ++p) {
      if (p > 0)
        while (done[p - 1].load(std::memory_order_acquire) < counts[p - 1]) cpu_pause();
      for (int64_t d = 0; d < shares; ++d) {
        const int64_t k = (begin + d) % shares, end = (k + 1) * counts[p] / shares;
        for (int64_t i = next[p][k].fetch_add(1, std::memory_order_relaxed); i < end;
             i = next[p][k].fetch_add(1, std::memory_order_relaxed)) {
          run(p, i);
          done[p].fetch_add(1, std::memory_order_acq_rel);
        }
      }
    }
  });
}

// Per-token symmetric quantization of one row: q = round-half-even(x / scale) with scale = absmax / 127
// (1 for a zero row), stored as q + 128; bytes [K, K4) of the padded row are 128 (q = 0). Returns scale.
float quantize_row(const float* x, int64_t K, uint8_t* q, int64_t K4) {
  int64_t k = 0;
  vec vamax = {};
  for (; k + kLanes <= K; k += kLanes) {
    const vec v = load(x + k);
    vamax = vmax(vamax, vmax(v, -v));
  }
  float amax = 0.0f;
  for (int i = 0; i < kLanes; ++i) amax = std::max(amax, vamax[i]);
  for (; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
  k = 0;
#ifdef MESHSERVE_INT8_VNNI
  const __m512 vs = _mm512_set1_ps(scale);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), offset = _mm512_set1_epi32(128);
  for (; k < K; k += kLanes) {
    const __mmask16 mask = K - k >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
    // division (not a reciprocal multiply) and round-to-nearest-even: bit for bit what torch computes
    const __m512i r = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_maskz_loadu_ps(mask, x + k), vs));
    const __m512i u = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(r, lo), hi), offset);
    _mm_mask_storeu_epi8(q + k, mask, _mm512_cvtepi32_epi8(u));
  }
#endif
  for (; k < K; ++k) {
    const float r = std::nearbyint(x[k] / scale);
    q[k] = static_cast<uint8_t>(static_cast<int>(std::min(127.0f, std::max(-127.0f, r))) + 128);
  }
  for (k = K; k < K4; ++k) q[k] = 128;
  return scale;
}

// acc[m * kAccStride + 16 v + c] = sum_k x[m, k] w[16 v + c, k] for M rows of x (u8, q + 128, row stride
// ldx) and NB blocks of w (block v at w + v * bstride), over G k-groups; starts from -compensation, or
// where comp is null from acc (the sums of the k-groups before these). Prefetches the weight a little
// ahead into L1, or (ahead) one chunk ahead into L2 (see matmul_blocks).
template <int M, int NB>
void int8_tile(const uint8_t* x, int64_t ldx, const int8_t* w, int64_t bstride, int64_t G, const int32_t* comp,
               int32_t* acc_out, bool ahead) {
#ifdef MESHSERVE_INT8_VNNI
  __m512i acc[M][NB];
#pragma GCC unroll 4
  for (int v = 0; v < NB; ++v) {
    const __m512i c = comp == nullptr ? _mm512_setzero_si512()
                                      : _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(comp + v * kLanes));
#pragma GCC unroll 12
    for (int m = 0; m < M; ++m)
      acc[m][v] = comp == nullptr ? _mm512_loadu_si512(acc_out + m * kAccStride + v * kLanes) : c;
  }
  for (int64_t g = 0; g < G; ++g) {
    __m512i wv[NB];
#pragma GCC unroll 4
    for (int v = 0; v < NB; ++v) {
      const int8_t* p = w + v * bstride + g * kGroupBytes;
      if (ahead)
        _mm_prefetch(reinterpret_cast<const char*>(p + kChunkGroups * kGroupBytes), _MM_HINT_T1);
      else
        _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchGroups * kGroupBytes), _MM_HINT_T0);
      wv[v] = _mm512_loadu_si512(p);
    }
#pragma GCC unroll 12
    for (int m = 0; m < M; ++m) {
      int32_t a;
      std::memcpy(&a, x + m * ldx + 4 * g, sizeof(a));
      const __m512i av = _mm512_set1_epi32(a);
#pragma GCC unroll 4
      for (int v = 0; v < NB; ++v) acc[m][v] = _mm512_dpbusd_epi32(acc[m][v], av, wv[v]);
    }
  }
#pragma GCC unroll 12
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < NB; ++v) _mm512_storeu_si512(acc_out + m * kAccStride + v * kLanes, acc[m][v]);
#else
  (void)ahead;  // no prefetching here
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < NB; ++v)
      for (int c = 0; c < kLanes; ++c) {
        const int8_t* wc = w + v * bstride + 4 * c;
        const uint8_t* xm = x + m * ldx;
        int32_t s = comp == nullptr ? acc_out[m * kAccStride + v * kLanes + c] : -comp[v * kLanes + c];
        for (int64_t g = 0; g < G; ++g)
          for (int i = 0; i < 4; ++i) s += int32_t(xm[4 * g + i]) * int32_t(wc[g * kGroupBytes + i]);
        acc_out[m * kAccStride + v * kLanes + c] = s;
      }
#endif
}

using TileFn = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, int64_t, const int32_t*, int32_t*, bool);
template <int NB, int... Ms>
constexpr std::array<TileFn, sizeof...(Ms)> tile_row(std::integer_sequence<int, Ms...>) {
  return {&int8_tile<Ms + 1, NB>...};
}
constexpr std::array<std::array<TileFn, kMaxRows>, kMaxBlocks> kTiles = {
    tile_row<1>(std::make_integer_sequence<int, kMaxRows>{}), tile_row<2>(std::make_integer_sequence<int, kMaxRows>{}),
    tile_row<3>(std::make_integer_sequence<int, kMaxRows>{}), tile_row<4>(std::make_integer_sequence<int, kMaxRows>{})};

// Rows per tile for NB blocks: the accumulators (rows x blocks) plus the weight vectors fit 32 registers.
constexpr int max_tile_rows(int nb) { return nb >= 4 ? 6 : nb == 3 ? 8 : kMaxRows; }

// Column blocks per task for a matmul of `rows` rows against `blocks` blocks: 4 (tiles of up to 6 rows, the
// best ratio of multiply-adds to loads), but 3 for 7 or 8 rows, which one 8-row tile then covers (the
// weight streams once), where that leaves no narrow last task or one among many.
inline int blocks_per_task(int64_t rows, int64_t blocks) {
  return (rows == 7 || rows == 8) && (blocks % 3 == 0 || blocks >= 24) ? 3 : 4;
}

// int32 results for rows [0, rows) of x against blocks [0, nb) of w, in tiles of balanced row counts;
// sink(first_row, tile_rows, acc) takes each tile's accumulators. Where several tiles share the weight
// they pass over it together, a chunk of k at a time: the first tile streams the chunk into L1, the others
// compute on it there and meanwhile fetch the next chunk into L2, so memory and arithmetic overlap.
template <typename Sink>
void matmul_blocks(const uint8_t* x, int64_t ldx, int64_t rows, const int8_t* w, int64_t bstride, int64_t G,
                   const int32_t* comp, int nb, const Sink& sink) {
  alignas(64) int32_t acc[kChunkTiles][kMaxRows * kAccStride];
  const int64_t per_tile = max_tile_rows(nb);
  int64_t tiles = (rows + per_tile - 1) / per_tile;
  for (int64_t r = 0; r < rows;) {
    const int n = static_cast<int>(std::min<int64_t>(tiles, kChunkTiles));
    int64_t first[kChunkTiles], count[kChunkTiles];
    for (int t = 0; t < n; ++t, --tiles) {
      first[t] = r;
      count[t] = (rows - r + tiles - 1) / tiles;
      r += count[t];
    }
    const int64_t chunk = n == 1 ? G : kChunkGroups;
    for (int64_t g0 = 0; g0 < G; g0 += chunk)
      for (int t = 0; t < n; ++t)
        kTiles[nb - 1][count[t] - 1](x + first[t] * ldx + 4 * g0, ldx, w + g0 * kGroupBytes, bstride,
                                     std::min(chunk, G - g0), g0 == 0 ? comp : nullptr, acc[t], t > 0);
    for (int t = 0; t < n; ++t) sink(first[t], count[t], acc[t]);
  }
}

// out[i, 0:16 nb] = (float(acc) * xscale[i]) * wscale (+ bias), rows of out `ldo` apart.
inline void dequantize(const int32_t* acc, int64_t m, int nb, const float* xscale, const float* wscale,
                       const float* bias, float* out, int64_t ldo) {
  for (int64_t i = 0; i < m; ++i)
    for (int v = 0; v < nb; ++v) {
      vec f = __builtin_convertvector(iload(acc + i * kAccStride + v * kLanes), vec) * xscale[i];
      f = f * load(wscale + v * kLanes);
      if (bias != nullptr) f = f + load(bias + v * kLanes);
      store(out + i * ldo + v * kLanes, f);
    }
}

struct PackedWeight {
  const int8_t* blocks;  // [E, N/16, G, 64]
  const int32_t* comp;   // [E, N]
  const float* scale;    // [E, N]
  int64_t experts, N, K, G;
  int64_t block_bytes() const { return G * kGroupBytes; }
  int64_t expert_bytes() const { return N * G * 4; }
};

PackedWeight check_packed(const at::Tensor& w, const at::Tensor& comp, const at::Tensor& scale, int64_t K,
                          const char* name) {
  TORCH_CHECK(w.dtype() == at::kChar && w.is_contiguous() && w.dim() >= 3 && w.numel() > 0 && w.size(-1) == kGroupBytes,
              name, ": packed weight must be contiguous int8 [..., N/16, ceil(K/4), 64] (int8.pack)");
  TORCH_CHECK(comp.dtype() == at::kInt && comp.is_contiguous() && scale.dtype() == at::kFloat && scale.is_contiguous(),
              name, ": compensation must be contiguous int32 and scale contiguous float32");
  TORCH_CHECK(K > 0 && K <= kMaxK && w.size(-2) == (K + 3) / 4, name, ": packed weight does not match K = ", K);
  const int64_t N = w.size(-3) * kLanes, experts = w.numel() / (w.size(-3) * w.size(-2) * kGroupBytes);
  TORCH_CHECK(comp.numel() == experts * N && scale.numel() == experts * N, name,
              ": compensation and scale need one value per output channel");
  return {w.data_ptr<int8_t>(), comp.data_ptr<int32_t>(), scale.data_ptr<float>(), experts, N, K, w.size(-2)};
}

// Scratch that lives with the calling thread and is reused by its calls (the worker threads write into
// it through pointers): no allocation per call once the sizes have been seen.
struct Scratch {
  std::vector<uint8_t> xq, aq;
  std::vector<float> xscale, ascale, act, ys;
  std::vector<int64_t> offsets, cursor, pair_row;
  std::vector<int32_t> tasks1, tasks2;
};
Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// v sized n (contents unspecified); a buffer grown by one large call (a long prefill) is given back once
// calls a quarter its size follow
template <typename T>
T* sized(std::vector<T>& v, size_t n) {
  if (v.capacity() > (size_t(1) << 22) && n < v.capacity() / 4) std::vector<T>().swap(v);
  v.resize(n);
  return v.data();
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& comp, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias) {
  // x float32 [M, K] (rows may be strided), w packed [N/16, G, 64] -> float32 [M, N]
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, "int8_linear takes float32 rows [M, K]");
  const int64_t rows = x.size(0), K = x.size(1);
  const PackedWeight pw = check_packed(w, comp, scale, K, "int8_linear");
  TORCH_CHECK(pw.experts == 1, "int8_linear takes one weight [N/16, G, 64]");
  const float* pb = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dtype() == at::kFloat && bias->is_contiguous() && bias->numel() == pw.N,
                "int8_linear: bias must be contiguous float32 [N]");
    pb = bias->data_ptr<float>();
  }
  const int64_t N = pw.N, G = pw.G;
  auto out = at::empty({rows, N}, x.options());
  if (rows == 0) return out;
  Scratch& s = scratch();
  const int64_t ldq = round_up(4 * G, 64);
  uint8_t* xq = sized(s.xq, rows * ldq);
  float* xs = sized(s.xscale, rows);
  const float* px = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  float* po = out.data_ptr<float>();

  const int nb = blocks_per_task(rows, N / kLanes);
  const int64_t blocks = N / kLanes, col_tasks = (blocks + nb - 1) / nb, threads = at::get_num_threads();
  // few column tasks and many rows: split the rows too, so every thread has work
  int64_t row_chunk = rows;
  if (rows > kMaxRows && col_tasks < 8 * threads) {
    const int64_t chunks = std::min<int64_t>((8 * threads + col_tasks - 1) / col_tasks, (rows + 11) / 12);
    row_chunk = round_up((rows + chunks - 1) / chunks, 6);
  }
  const int64_t row_tasks = (rows + row_chunk - 1) / row_chunk;
  const int64_t quant_rows = std::max<int64_t>(1, 16384 / K);  // rows per quantization task
  const std::array<int64_t, 2> counts = {(rows + quant_rows - 1) / quant_rows, col_tasks * row_tasks};
  run_phases(counts, rows * N * K >= kSerialWork, [&](size_t phase, int64_t i) {
    if (phase == 0) {
      for (int64_t r = i * quant_rows; r < std::min(rows, (i + 1) * quant_rows); ++r)
        xs[r] = quantize_row(px + r * ldx, K, xq + r * ldq, 4 * G);
      return;
    }
    const int64_t b0 = (i / row_tasks) * nb, r0 = (i % row_tasks) * row_chunk;
    const int n = static_cast<int>(std::min<int64_t>(nb, blocks - b0));
    const int64_t col = b0 * kLanes;
    matmul_blocks(xq + r0 * ldq, ldq, std::min(row_chunk, rows - r0), pw.blocks + b0 * pw.block_bytes(),
                  pw.block_bytes(), G, pw.comp + col, n, [&](int64_t r, int64_t m, const int32_t* acc) {
                    dequantize(acc, m, n, xs + r0 + r, pw.scale + col, pb == nullptr ? nullptr : pb + col,
                               po + (r0 + r) * N + col, N);
                  });
  });
  return out;
}

at::Tensor int8_moe_forward(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                            int64_t first_slot, const at::Tensor& w13, const at::Tensor& w13_comp,
                            const at::Tensor& w13_scale, const at::Tensor& w2, const at::Tensor& w2_comp,
                            const at::Tensor& w2_scale) {
  // out[t] = sum_k w[t, k] * expert_{ids[t, k]}(hidden[t]) over the slots [first_slot, first_slot + E) held
  // here; expert(x) = W2 q(silu(W_gate q(x)) * (W_up q(x))), q = per-row int8 quantization.
  TORCH_CHECK(hidden.dtype() == at::kFloat && hidden.is_contiguous() && hidden.dim() == 2,
              "int8_moe_forward takes float32 hidden states [T, H]");
  TORCH_CHECK(topk_ids.dtype() == at::kLong && topk_weights.dtype() == at::kFloat && topk_ids.dim() == 2 &&
                  topk_ids.sizes() == topk_weights.sizes() && topk_ids.size(0) == hidden.size(0),
              "int8_moe_forward: topk ids (int64) and weights (float32) must be [T, K]");
  const int64_t tokens = hidden.size(0), top_k = topk_ids.size(1), H = hidden.size(1);
  const PackedWeight p13 = check_packed(w13, w13_comp, w13_scale, H, "int8_moe_forward w13");
  TORCH_CHECK(p13.N % (2 * kLanes) == 0, "int8_moe_forward: w13 needs 2I rows with I a multiple of 16");
  const int64_t inter = p13.N / 2;
  const PackedWeight p2 = check_packed(w2, w2_comp, w2_scale, inter, "int8_moe_forward w2");
  TORCH_CHECK(p2.N == H && p2.experts == p13.experts && w13.dim() == 4 && w2.dim() == 4,
              "int8_moe_forward: w13 [E, 2I/16, G, 64] and w2 [E, H/16, G, 64] do not match");
  const int64_t experts = p13.experts;
  const auto ids_c = topk_ids.contiguous();
  const auto wts_c = topk_weights.contiguous();
  const int64_t* ids = ids_c.data_ptr<int64_t>();
  const float* wts = wts_c.data_ptr<float>();
  auto out = at::empty_like(hidden);
  Scratch& s = scratch();

  // stable counting sort of the (token, k) pairs by local expert; pairs routed elsewhere get row -1
  s.offsets.assign(experts + 1, 0);
  s.pair_row.assign(tokens * top_k, -1);
  for (int64_t i = 0; i < tokens * top_k; ++i) {
    const int64_t e = ids[i] - first_slot;
    if (0 <= e && e < experts) ++s.offsets[e + 1];
  }
  for (int64_t e = 0; e < experts; ++e) s.offsets[e + 1] += s.offsets[e];
  const int64_t rows = s.offsets[experts];
  if (rows == 0) return out.zero_();
  s.cursor.assign(s.offsets.begin(), s.offsets.end() - 1);
  for (int64_t i = 0; i < tokens * top_k; ++i) {
    const int64_t e = ids[i] - first_slot;
    if (0 <= e && e < experts) s.pair_row[i] = s.cursor[e]++;
  }
  // work items: (expert, first block, blocks) of the intermediate columns (stage 1) and hidden columns (stage 2)
  const int64_t* off = s.offsets.data();
  auto make_tasks = [&](std::vector<int32_t>& tasks, int64_t blocks) {
    tasks.clear();
    for (int64_t e = 0; e < experts; ++e) {
      if (off[e + 1] == off[e]) continue;
      const int nb = blocks_per_task(off[e + 1] - off[e], blocks);
      for (int64_t b = 0; b < blocks; b += nb)
        tasks.insert(tasks.end(), {int32_t(e), int32_t(b), int32_t(std::min<int64_t>(nb, blocks - b))});
    }
  };
  make_tasks(s.tasks1, inter / kLanes);
  make_tasks(s.tasks2, H / kLanes);

  const int64_t ldx = round_up(4 * p13.G, 64), lda = round_up(4 * p2.G, 64);
  uint8_t* xq = sized(s.xq, rows * ldx);
  uint8_t* aq = sized(s.aq, rows * lda);
  float *xs = sized(s.xscale, rows), *as = sized(s.ascale, rows), *act = sized(s.act, rows * inter),
        *ys = sized(s.ys, rows * H);
  const int64_t* pair_row = s.pair_row.data();
  const int32_t *t1 = s.tasks1.data(), *t2 = s.tasks2.data();
  const float* h = hidden.data_ptr<float>();
  float* po = out.data_ptr<float>();
  const int64_t token_chunk = std::max<int64_t>(1, 8192 / H), row_chunk = std::max<int64_t>(1, 8192 / inter);
  const std::array<int64_t, 5> counts = {(tokens + token_chunk - 1) / token_chunk,
                                         static_cast<int64_t>(s.tasks1.size() / 3),
                                         (rows + row_chunk - 1) / row_chunk,
                                         static_cast<int64_t>(s.tasks2.size() / 3),
                                         (tokens + token_chunk - 1) / token_chunk};
  const bool parallel = rows * 3 * inter * H >= kSerialWork;
  run_phases(counts, parallel, [&](size_t phase, int64_t i) {
    switch (phase) {
      case 0:  // quantize each token once, into the first of its rows; its other rows copy it
        for (int64_t t = i * token_chunk; t < std::min(tokens, (i + 1) * token_chunk); ++t) {
          int64_t first = -1;
          for (int64_t k = 0; k < top_k; ++k) {
            const int64_t r = pair_row[t * top_k + k];
            if (r < 0) continue;
            if (first < 0) {
              xs[r] = quantize_row(h + t * H, H, xq + r * ldx, 4 * p13.G);
              first = r;
            } else {
              xs[r] = xs[first];
              std::memcpy(xq + r * ldx, xq + first * ldx, ldx);
            }
          }
        }
        break;
      case 1: {  // act[:, cols] = silu(gate) * up for one expert's rows and one group of intermediate columns
        const int64_t e = t1[3 * i], b0 = t1[3 * i + 1], col = b0 * kLanes;
        const int nb = t1[3 * i + 2];
        const int8_t* we = p13.blocks + e * p13.expert_bytes();
        const int32_t* ce = p13.comp + e * p13.N;
        const float* se = p13.scale + e * p13.N;
        const int64_t r0 = off[e], n = off[e + 1] - r0, bb = p13.block_bytes();
        float* a0 = act + r0 * inter + col;
        matmul_blocks(xq + r0 * ldx, ldx, n, we + b0 * bb, bb, p13.G, ce + col, nb,
                      [&](int64_t r, int64_t m, const int32_t* acc) {
                        dequantize(acc, m, nb, xs + r0 + r, se + col, nullptr, a0 + r * inter, inter);
                      });
        matmul_blocks(xq + r0 * ldx, ldx, n, we + (inter / kLanes + b0) * bb, bb, p13.G, ce + inter + col, nb,
                      [&](int64_t r, int64_t m, const int32_t* acc) {
                        alignas(64) float up[kMaxRows * kAccStride];
                        dequantize(acc, m, nb, xs + r0 + r, se + inter + col, nullptr, up, kAccStride);
                        for (int64_t j = 0; j < m; ++j)
                          for (int v = 0; v < nb; ++v) {
                            float* dst = a0 + (r + j) * inter + v * kLanes;
                            const vec g = load(dst);
                            store(dst, g / (1.0f + vexp(-g)) * load(up + j * kAccStride + v * kLanes));
                          }
                      });
        break;
      }
      case 2:  // quantize each (token, expert) row of the activation
        for (int64_t r = i * row_chunk; r < std::min(rows, (i + 1) * row_chunk); ++r)
          as[r] = quantize_row(act + r * inter, inter, aq + r * lda, 4 * p2.G);
        break;
      case 3: {  // ys[:, cols] = act W2^T for one expert's rows and one group of hidden columns
        const int64_t e = t2[3 * i], b0 = t2[3 * i + 1], col = b0 * kLanes;
        const int nb = t2[3 * i + 2];
        const int64_t r0 = off[e];
        matmul_blocks(aq + r0 * lda, lda, off[e + 1] - r0, p2.blocks + e * p2.expert_bytes() + b0 * p2.block_bytes(),
                      p2.block_bytes(), p2.G, p2.comp + e * H + col, nb,
                      [&](int64_t r, int64_t m, const int32_t* acc) {
                        dequantize(acc, m, nb, as + r0 + r, p2.scale + e * H + col, nullptr, ys + (r0 + r) * H + col,
                                   H);
                      });
        break;
      }
      default:  // each token sums its experts' rows in k order
        for (int64_t t = i * token_chunk; t < std::min(tokens, (i + 1) * token_chunk); ++t) {
          float* dst = po + t * H;
          std::fill(dst, dst + H, 0.0f);
          for (int64_t k = 0; k < top_k; ++k) {
            const int64_t r = pair_row[t * top_k + k];
            if (r < 0) continue;
            const float w = wts[t * top_k + k];
            const float* src = ys + r * H;
            for (int64_t c = 0; c < H; c += kLanes) store(dst + c, load(dst + c) + w * load(src + c));
          }
        }
    }
  });
  return out;
}

bool int8_vnni() {
#ifdef MESHSERVE_INT8_VNNI
  return true;
#else
  return false;
#endif
}

}  // namespace

// The kernels above as the fused decode layer calls them (decode_layer.cpp), without the dispatcher.
namespace meshserve_kernels {
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& comp, const at::Tensor& scale) {
  return ::int8_linear(x, w, comp, scale, c10::nullopt);
}
at::Tensor int8_moe_forward(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                            int64_t first_slot, const at::Tensor& w13, const at::Tensor& w13_comp,
                            const at::Tensor& w13_scale, const at::Tensor& w2, const at::Tensor& w2_comp,
                            const at::Tensor& w2_scale) {
  return ::int8_moe_forward(hidden, topk_ids, topk_weights, first_slot, w13, w13_comp, w13_scale, w2, w2_comp,
                            w2_scale);
}
}  // namespace meshserve_kernels

TORCH_LIBRARY_FRAGMENT(meshserve_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor w, Tensor comp, Tensor scale, Tensor? bias) -> Tensor");
  m.def("int8_moe_forward(Tensor hidden, Tensor topk_ids, Tensor topk_weights, int first_slot, Tensor w13, "
        "Tensor w13_comp, Tensor w13_scale, Tensor w2, Tensor w2_comp, Tensor w2_scale) -> Tensor");
  m.def("int8_vnni() -> bool", &int8_vnni);
}

TORCH_LIBRARY_IMPL(meshserve_cpu, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_moe_forward", &int8_moe_forward);
}
