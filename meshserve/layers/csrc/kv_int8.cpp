// Absorbed MLA decode attention over an INT8 paged latent cache (meshserve/layers/kv_quant.py), and over a
// bfloat16 one (a bfloat16 model's: its rows are converted to float32 tile by tile, the float path below).
//
// A cache row is [c_kv int8 x kv_lora_rank | k_pe int8 x rope_dim | scale_c bf16 | scale_pe bf16]. The
// kernel works like mla_decode (cpu_kernels.cpp): one task per sequence and group of kLanes heads, the
// context walked in tiles of up to kLanes tokens of one block with an online softmax, so the cache is read
// once and never gathered. Each tile is first dequantized into a small float32 buffer (int8 x its part's
// scale, one vector at a time), which the scores and P·c then read from L1; everything accumulates in
// float32.
//
// With AVX512-VNNI and `int8_scores`, the scores are integer dot products instead: the query is quantized
// per head and per part (latent, rope) to int8, and one vpdpbusd multiplies four cache bytes, broadcast from
// the row itself, with four query bytes of all 16 heads. The query is the unsigned operand (+128), so the
// score loses 128 x the row's byte sum, taken while the latent part is converted for P·c. Only the latent part
// is converted (without its scale, which goes into the probabilities): a token takes a quarter of the score
// instructions and no scaled tile. The query's rounding is the path's only difference (the reference in
// tests/layers/test_kv_int8.py applies it too; its effect on a trained model is in docs/benchmarks.md).
//
// Written with GCC vector extensions of the machine's own width, as cpu_kernels.cpp (16 floats on AVX-512,
// 8 on AVX2, 4 on NEON or SSE), and built with the other kernel files into one extension (-march=native).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "parallel_tasks.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

using meshserve_kernels::combine_parts;
using meshserve_kernels::parallel_tasks;
using meshserve_kernels::split_count;

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16, kVectorRegisters = 32;
#elif defined(__AVX__)
constexpr int kLanes = 8, kVectorRegisters = 16;
#elif defined(__ARM_NEON)
constexpr int kLanes = 4, kVectorRegisters = 32;
#else
constexpr int kLanes = 4, kVectorRegisters = 16;
#endif
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int ivec __attribute__((vector_size(kLanes * sizeof(int))));
typedef int8_t bvec __attribute__((vector_size(kLanes)));
constexpr int kHalfTile = kLanes / 2;  // tokens scored at once: kLanes query vectors + kLanes / 2 accumulators
constexpr int64_t kScaleBytes = 2;

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(vec));
  return v;
}
inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof(vec)); }
inline vec splat(float s) { return vec{} + s; }
inline vec vmax(vec a, vec b) { return a > b ? a : b; }
inline vec vmin(vec a, vec b) { return a < b ? a : b; }

// kLanes int8 -> kLanes floats. On x86 through the sign-extending load (vpmovsxbd) and one convert: GCC lowers
// the generic int8 -> int32 vector conversion to a shift and an insert per lane, which made the kernel 2.5x
// slower than the float32 one.
inline vec load_i8(const int8_t* p) {
#if defined(__AVX512F__)
  return (vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return (vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  bvec b;
  std::memcpy(&b, p, sizeof(bvec));
  return __builtin_convertvector(__builtin_convertvector(b, ivec), vec);
#endif
}

inline float load_bf16(const int8_t* p) {
  uint16_t half;
  std::memcpy(&half, p, sizeof(half));
  const uint32_t bits = uint32_t(half) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// exp(x) lane by lane: Cephes range reduction and polynomial (relative error ~2e-7).
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

constexpr int64_t kLineFloats = 64 / sizeof(float);
inline float* align_to_line(float* p) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}

// tile[t, :] = the dequantized entry of `tokens` consecutive cache rows (width bytes each). The next tile's
// rows (`next`, `next_bytes`) are prefetched a row's worth per row, spread over the loop.
void dequantize_tile(const int8_t* rows, int64_t width, int tokens, int64_t kv_lora_rank, int64_t dim, float* tile,
                     const int8_t* next, int64_t next_bytes) {
  for (int t = 0; t < tokens; ++t) {
    for (int64_t i = t * width; i < std::min((t + 1) * width, next_bytes); i += 64) __builtin_prefetch(next + i);
    const int8_t* row = rows + t * width;
    const vec s_c = splat(load_bf16(row + dim)), s_pe = splat(load_bf16(row + dim + kScaleBytes));
    float* out = tile + t * dim;
    int64_t d = 0;
    for (; d < kv_lora_rank; d += kLanes) store(out + d, load_i8(row + d) * s_c);
    for (; d < dim; d += kLanes) store(out + d, load_i8(row + d) * s_pe);
  }
}

// s[t] (lanes = heads) = sum_d qt[d] * tile[t, d] for T tokens; qt is the query group as [dim][kLanes heads].
template <int T>
void score_tokens(const float* qt, const float* tile, int64_t dim, vec* s) {
  vec acc[T] = {};
  for (int64_t d0 = 0; d0 < dim; d0 += kLanes) {
    vec q[kLanes];
#pragma GCC unroll 16
    for (int i = 0; i < kLanes; ++i) q[i] = load(qt + (d0 + i) * kLanes);
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      const float* row = tile + t * dim + d0;
#pragma GCC unroll 16
      for (int i = 0; i < kLanes; ++i) acc[t] += q[i] * row[i];
    }
  }
  for (int t = 0; t < T; ++t) s[t] = acc[t];
}

using ScoreFn = void (*)(const float*, const float*, int64_t, vec*);
template <int... Ts>
constexpr std::array<ScoreFn, sizeof...(Ts)> score_table(std::integer_sequence<int, Ts...>) {
  return {&score_tokens<Ts + 1>...};
}
constexpr auto kScores = score_table(std::make_integer_sequence<int, kHalfTile>{});

// acc[h, c] = acc[h, c] * alpha[h] + sum_t p[t, h] * tile[t, c] over latent vectors [c0, c0 + N) of H
// consecutive heads (each tile vector loaded once serves them all); probs is [t][kLanes heads] from the first.
// A chunk's H x N accumulators and N loaded vectors stay in registers: N = 8 with 32 registers, 4 with 16.
template <int N, int H>
inline void pv_chunk(float* acc, int64_t ld_acc, const float* alpha, const float* probs, const float* tile,
                     int64_t dim, int tokens) {
  vec va[H][N];
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < N; ++i) va[h][i] = load(acc + h * ld_acc + i * kLanes) * alpha[h];
  for (int t = 0; t < tokens; ++t) {
    vec row[N];
    for (int i = 0; i < N; ++i) row[i] = load(tile + t * dim + i * kLanes);
    for (int h = 0; h < H; ++h) {
      const float p = probs[t * kLanes + h];
      for (int i = 0; i < N; ++i) va[h][i] += row[i] * p;
    }
  }
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < N; ++i) store(acc + h * ld_acc + i * kLanes, va[h][i]);
}

template <int H>
void accumulate_pv(float* acc, int64_t kv_lora_rank, const float* alpha, const float* probs, const float* tile,
                   int64_t dim, int tokens) {
  int64_t c = 0;
  constexpr int kWide = kVectorRegisters >= 32 ? 8 : 4;
  for (; c + kWide * kLanes <= kv_lora_rank; c += kWide * kLanes)
    pv_chunk<kWide, H>(acc + c, kv_lora_rank, alpha, probs, tile + c, dim, tokens);
  for (; c + 4 * kLanes <= kv_lora_rank; c += 4 * kLanes)
    pv_chunk<4, H>(acc + c, kv_lora_rank, alpha, probs, tile + c, dim, tokens);
  for (; c < kv_lora_rank; c += kLanes) pv_chunk<1, H>(acc + c, kv_lora_rank, alpha, probs, tile + c, dim, tokens);
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
constexpr bool kInt8Scores = true;

// The group's query for integer scores: per head h and part (latent [0, c), rope [c, dim)), q8 = q * 127 / max|q|
// rounded to nearest even, stored +128 as [dim / 4][16 heads][4 bytes] (a padding head is 128: q8 = 0); the
// factors turn a part's integer dot product back into a scaled score: softmax scale x max|q| / 127.
void quantize_query(const float* q, int64_t heads, int64_t dim, int64_t c, float softmax_scale, uint8_t* q8,
                    float* factor_c, float* factor_pe) {
  std::memset(q8, 128, dim * kLanes);
  for (int h = 0; h < kLanes; ++h) factor_c[h] = factor_pe[h] = 0.0f;
  for (int64_t h = 0; h < heads; ++h) {
    const float* row = q + h * dim;
    for (int part = 0; part < 2; ++part) {  // both parts are whole vectors (checked by the caller)
      const int64_t begin = part ? c : 0, end = part ? dim : c;
      __m512 amax = _mm512_setzero_ps();
      for (int64_t d = begin; d < end; d += kLanes) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(row + d)));
      const float largest = _mm512_reduce_max_ps(amax);
      const __m512 inverse = _mm512_set1_ps(largest > 0.0f ? 127.0f / largest : 0.0f);
      for (int64_t d = begin; d < end; d += kLanes) {
        // round to nearest even (the default rounding mode), +128, to bytes; 4 dims per head per group of 4
        const __m512i rounded = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + d), inverse));
        alignas(16) uint8_t bytes[kLanes];
        _mm_store_si128(reinterpret_cast<__m128i*>(bytes),
                        _mm512_cvtepi32_epi8(_mm512_add_epi32(rounded, _mm512_set1_epi32(128))));
        for (int j = 0; j < kLanes / 4; ++j) std::memcpy(q8 + (d / 4 + j) * kLanes * 4 + h * 4, bytes + 4 * j, 4);
      }
      (part ? factor_pe : factor_c)[h] = largest / 127.0f * softmax_scale;
    }
  }
}

// tile[t, 0:c] = the latent part of `tokens` cache rows as floats, unscaled (the scale goes into the
// probabilities); sums[t] = each part's byte sum (latent, rope), for the scores' +128 correction. The next
// tile's rows are prefetched as in dequantize_tile.
void convert_latent(const int8_t* rows, int64_t width, int tokens, int64_t c, int64_t dim, float* tile,
                    float (*sums)[2], const int8_t* next, int64_t next_bytes) {
  for (int t = 0; t < tokens; ++t) {
    for (int64_t i = t * width; i < std::min((t + 1) * width, next_bytes); i += 64) __builtin_prefetch(next + i);
    const int8_t* row = rows + t * width;
    float* out = tile + t * c;
    vec sum_c = {}, sum_pe = {};
    int64_t d = 0;
    for (; d < c; d += kLanes) {
      const vec v = load_i8(row + d);
      sum_c += v;
      store(out + d, v);
    }
    for (; d < dim; d += kLanes) sum_pe += load_i8(row + d);
    sums[t][0] = _mm512_reduce_add_ps((__m512)sum_c);
    sums[t][1] = _mm512_reduce_add_ps((__m512)sum_pe);
  }
}

// One part's integer scores of T tokens: acc[t] (lanes = heads) += sum over the part's bytes of q8 x row.
template <int T>
void dot_part(const uint8_t* q8, const int8_t* rows, int64_t width, int64_t begin, int64_t end, __m512i* acc) {
  for (int64_t d = begin; d < end; d += 4) {
    const __m512i qv = _mm512_loadu_si512(q8 + d * kLanes);
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) {
      int32_t bytes;
      std::memcpy(&bytes, rows + t * width + d, sizeof(bytes));
      acc[t] = _mm512_dpbusd_epi32(acc[t], qv, _mm512_set1_epi32(bytes));
    }
  }
}

// s[t] = the T tokens' scaled scores: each part's integer dot product less 128 x its byte sum, times the
// row's scale for the part and the query's factor.
template <int T>
void int8_scores(const uint8_t* q8, const int8_t* rows, int64_t width, int64_t c, int64_t dim, const float* factor_c,
                 const float* factor_pe, const float (*sums)[2], vec* s) {
  const vec fc = load(factor_c), fpe = load(factor_pe);
  __m512i acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_si512();
  dot_part<T>(q8, rows, width, 0, c, acc);
  for (int t = 0; t < T; ++t) {
    const vec dot = (vec)_mm512_cvtepi32_ps(acc[t]) - 128.0f * sums[t][0];
    s[t] = dot * fc * load_bf16(rows + t * width + dim);
    acc[t] = _mm512_setzero_si512();
  }
  dot_part<T>(q8, rows, width, c, dim, acc);
  for (int t = 0; t < T; ++t) {
    const vec dot = (vec)_mm512_cvtepi32_ps(acc[t]) - 128.0f * sums[t][1];
    s[t] += dot * fpe * load_bf16(rows + t * width + dim + kScaleBytes);
  }
}

using Int8ScoreFn = void (*)(const uint8_t*, const int8_t*, int64_t, int64_t, int64_t, const float*, const float*,
                             const float (*)[2], vec*);
template <int... Ts>
constexpr std::array<Int8ScoreFn, sizeof...(Ts)> int8_score_table(std::integer_sequence<int, Ts...>) {
  return {&int8_scores<Ts + 1>...};
}
constexpr auto kInt8ScoreFns = int8_score_table(std::make_integer_sequence<int, kLanes>{});
#else
constexpr bool kInt8Scores = false;
#endif

bool int8_scores_native() { return kInt8Scores; }

// tile[t, :] = `tokens` consecutive bfloat16 cache rows (width bytes each) as float32 (the high half of each
// float); the next tile's rows are prefetched as in dequantize_tile.
void convert_bf16_tile(const int8_t* rows, int64_t width, int tokens, int64_t dim, float* tile, const int8_t* next,
                       int64_t next_bytes) {
  for (int t = 0; t < tokens; ++t) {
    for (int64_t i = t * width; i < std::min((t + 1) * width, next_bytes); i += 64) __builtin_prefetch(next + i);
    const auto* row = reinterpret_cast<const uint16_t*>(rows + t * width);
    float* out = tile + t * dim;
#if defined(__AVX512F__)
    for (int64_t d = 0; d < dim; d += kLanes) {
      const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + d)));
      _mm512_storeu_ps(out + d, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
    }
#else
    for (int64_t d = 0; d < dim; ++d) {
      const uint32_t bits = uint32_t(row[d]) << 16;
      std::memcpy(out + d, &bits, sizeof(float));
    }
#endif
  }
}

enum class Rows { kInt8, kBf16 };

at::Tensor decode_rows(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_table,
                       const at::Tensor& seq_lens, double scale, int64_t kv_lora_rank, Rows format, bool int8_scores);

at::Tensor mla_decode_int8(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_table,
                           const at::Tensor& seq_lens, double scale, int64_t kv_lora_rank,
                           bool int8_scores) {
  // q [B, heads, D] float32 (absorbed query: latent part then rope part), cache int8 [blocks, block_size,
  // D + 4], block_table int64 [B, >= blocks per sequence], seq_lens int64 [B] -> P·c [B, heads, kv_lora_rank].
  TORCH_CHECK(cache.dtype() == at::kChar, "mla_decode_int8 takes an int8 cache");
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 3 && cache.size(2) == q.size(2) + 2 * kScaleBytes,
              "mla_decode_int8: cache rows, entry and latent sizes do not match");
  return decode_rows(q, cache, block_table, seq_lens, scale, kv_lora_rank, Rows::kInt8, int8_scores);
}

at::Tensor mla_decode_bf16(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_table,
                           const at::Tensor& seq_lens, double scale, int64_t kv_lora_rank) {
  // as mla_decode_int8 over a bfloat16 cache [blocks, block_size, D] (a bfloat16 model's), float32 math
  TORCH_CHECK(cache.dtype() == at::kBFloat16, "mla_decode_bf16 takes a bfloat16 cache");
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 3 && cache.size(2) == q.size(2),
              "mla_decode_bf16: cache rows, entry and latent sizes do not match");
  return decode_rows(q, cache, block_table, seq_lens, scale, kv_lora_rank, Rows::kBf16, false);
}

// The kernel of both: q [B, heads, D] float32; `format` says what a cache row holds.
at::Tensor decode_rows(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_table,
                       const at::Tensor& seq_lens, double scale, int64_t kv_lora_rank, Rows format, bool int8_scores) {
  TORCH_CHECK(q.dtype() == at::kFloat, "MLA decode takes a float32 query");
  TORCH_CHECK(q.is_contiguous() && cache.is_contiguous(), "MLA decode takes contiguous q and cache");
  TORCH_CHECK(block_table.dtype() == at::kLong && seq_lens.dtype() == at::kLong, "MLA decode takes int64 tables");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), block_size = cache.size(1);
  const int64_t width = cache.size(2) * cache.element_size();  // bytes per row
  TORCH_CHECK(kv_lora_rank % kLanes == 0 && dim % kLanes == 0 && kv_lora_rank <= dim,
              "MLA decode: the latent and entry sizes must be whole vectors");
  TORCH_CHECK(block_table.size(0) == batch && seq_lens.size(0) == batch, "MLA decode: batch sizes differ");
  const auto table = block_table.contiguous();
  const auto lens = seq_lens.contiguous();
  const int64_t* bt = table.data_ptr<int64_t>();
  const int64_t* sl = lens.data_ptr<int64_t>();
  const int64_t table_stride = table.size(1), num_cache_blocks = cache.size(0);
  for (int64_t b = 0; b < batch; ++b) {  // checked here: the tasks below run on other threads
    const int64_t used = (sl[b] + block_size - 1) / block_size;
    TORCH_CHECK(sl[b] >= 0 && used <= table_stride, "MLA decode: a sequence is longer than its block table");
    for (int64_t i = 0; i < used; ++i)
      TORCH_CHECK(bt[b * table_stride + i] >= 0 && bt[b * table_stride + i] < num_cache_blocks,
                  "MLA decode: block id out of range");
  }
  auto out = at::empty({batch, heads, kv_lora_rank}, q.options());
  const float* pq = q.data_ptr<float>();
  const int8_t* pc = static_cast<const int8_t*>(cache.data_ptr());
  float* po = out.data_ptr<float>();
  const int64_t groups = (heads + kLanes - 1) / kLanes;

  // one task per sequence and head group; where that leaves threads idle (batch 1), each sequence's context is
  // split into parts that run as tasks of their own, their softmax states combined afterwards
  const int64_t splits = split_count(batch * groups, batch ? *std::max_element(sl, sl + batch) : 0);
  const int64_t part_floats = kLanes * kv_lora_rank + 2 * kLanes;  // a part's P·c rows, then m and l
  std::vector<float> parts(splits > 1 ? batch * groups * splits * part_floats : 0);

  const bool integer = int8_scores && kInt8Scores && format == Rows::kInt8;
  parallel_tasks(batch * groups * splits, [&](int64_t task) {
    thread_local std::vector<float> qt_buffer, acc_buffer, tile_buffer;  // per thread, reused by its tasks
    // on cache-line boundaries, so the tile's rows (a multiple of 64 bytes) are read in whole lines: malloc's
    // 16-byte alignment split every vector load in two (the kernel ran 1.36x slower)
    qt_buffer.resize(dim * kLanes + kLineFloats);
    acc_buffer.resize(kLanes * kv_lora_rank + kLineFloats);
    tile_buffer.resize(kLanes * dim + kLineFloats);
    float* qt = align_to_line(qt_buffer.data());
    float* acc = align_to_line(acc_buffer.data());
    float* tile = align_to_line(tile_buffer.data());
    float probs[kLanes][kLanes], alpha[kLanes];
    vec s[kLanes];
    const int64_t part = task % splits, b = task / splits / groups, h0 = (task / splits % groups) * kLanes;
    const int64_t hg = std::min<int64_t>(kLanes, heads - h0), len = sl[b];
    const int64_t chunk = (len + splits - 1) / splits, begin = std::min(len, part * chunk);
    const int64_t end = std::min(len, begin + chunk);
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    thread_local std::vector<uint8_t> q8_buffer;
    float factor_c[kLanes], factor_pe[kLanes], sums[kLanes][2];
    if (integer) {
      q8_buffer.resize(dim * kLanes);
      quantize_query(pq + (b * heads + h0) * dim, hg, dim, kv_lora_rank, float(scale), q8_buffer.data(), factor_c,
                     factor_pe);
    }
#endif
    // the float path's query, transposed to [D][kLanes heads] and scaled (padding heads are zero)
    if (!integer) {
      std::fill(qt, qt + dim * kLanes, 0.0f);
      for (int64_t h = 0; h < hg; ++h)
        for (int64_t d = 0; d < dim; ++d) qt[d * kLanes + h] = pq[(b * heads + h0 + h) * dim + d] * float(scale);
    }
    const int64_t tile_stride = integer ? kv_lora_rank : dim;  // floats per token in the tile
    std::fill(acc, acc + kLanes * kv_lora_rank, 0.0f);
    vec m = splat(-FLT_MAX), l = {};
    int tokens = 0;
    for (int64_t t0 = begin; t0 < end; t0 += tokens) {
      // a tile is up to kLanes tokens of one block
      const int64_t block = bt[b * table_stride + t0 / block_size], in_block = t0 % block_size;
      tokens = static_cast<int>(std::min({int64_t(kLanes), end - t0, block_size - in_block}));
      const int8_t* rows = pc + (block * block_size + in_block) * width;
      const int64_t next = t0 + tokens;
      const int8_t* nrows = nullptr;
      int64_t n = 0;
      if (next < end) {  // the next tile's rows stream in while this one computes
        const int64_t next_block = bt[b * table_stride + next / block_size];
        nrows = pc + (next_block * block_size + next % block_size) * width;
        n = std::min({int64_t(kLanes), end - next, block_size - next % block_size}) * width;
      }
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
      if (integer) {
        convert_latent(rows, width, tokens, kv_lora_rank, dim, tile, sums, nrows, n);
        kInt8ScoreFns[tokens - 1](q8_buffer.data(), rows, width, kv_lora_rank, dim, factor_c, factor_pe, sums, s);
      }
#endif
      if (!integer) {
        if (format == Rows::kBf16)
          convert_bf16_tile(rows, width, tokens, dim, tile, nrows, n);
        else
          dequantize_tile(rows, width, tokens, kv_lora_rank, dim, tile, nrows, n);
        for (int t = 0; t < tokens; t += kHalfTile) {
          const int n = std::min(kHalfTile, tokens - t);
          kScores[n - 1](qt, tile + t * dim, dim, s + t);
        }
      }
      vec tile_max = s[0];
      for (int t = 1; t < tokens; ++t) tile_max = vmax(tile_max, s[t]);
      const vec m_new = vmax(m, tile_max);
      const vec rescale = vexp(m - m_new);
      l *= rescale;
      for (int t = 0; t < tokens; ++t) {
        const vec p = vexp(s[t] - m_new);
        l += p;
        // the integer path's tile is unscaled: the row's latent scale multiplies its probabilities instead
        store(probs[t], integer ? p * load_bf16(rows + t * width + dim) : p);
      }
      m = m_new;
      store(alpha, rescale);
      int64_t h = 0;
      for (; h + 2 <= hg; h += 2)
        accumulate_pv<2>(acc + h * kv_lora_rank, kv_lora_rank, alpha + h, &probs[0][h], tile, tile_stride,
                         tokens);
      if (h < hg)
        accumulate_pv<1>(acc + h * kv_lora_rank, kv_lora_rank, alpha + h, &probs[0][h], tile, tile_stride,
                         tokens);
    }
    if (splits > 1) {  // this part's state, combined below
      float* state = parts.data() + task * part_floats;
      std::copy(acc, acc + kLanes * kv_lora_rank, state);
      store(state + kLanes * kv_lora_rank, m);
      store(state + kLanes * kv_lora_rank + kLanes, l);
      return;
    }
    float norm[kLanes];
    store(norm, l);
    for (int64_t h = 0; h < hg; ++h) {
      const float inv = len > 0 ? 1.0f / norm[h] : 0.0f;
      float* dst = po + (b * heads + h0 + h) * kv_lora_rank;
      for (int64_t c = 0; c < kv_lora_rank; ++c) dst[c] = acc[h * kv_lora_rank + c] * inv;
    }
  });
  if (splits > 1) combine_parts(parts.data(), splits, batch * groups, groups, heads, kv_lora_rank, po);
  return out;
}

}  // namespace

namespace meshserve_kernels {  // for the fused decode layers (decode_layer.cpp)
at::Tensor mla_decode_bf16(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_table,
                           const at::Tensor& seq_lens, double scale, int64_t kv_lora_rank) {
  return ::mla_decode_bf16(q, cache, block_table, seq_lens, scale, kv_lora_rank);
}
}  // namespace meshserve_kernels

TORCH_LIBRARY_FRAGMENT(meshserve_cpu, m) {
  m.def("mla_decode_int8(Tensor q, Tensor cache, Tensor block_table, Tensor seq_lens, float scale, "
        "int kv_lora_rank, bool int8_scores) -> Tensor");
  m.def("mla_decode_int8_scores_native() -> bool");
  m.def("mla_decode_bf16(Tensor q, Tensor cache, Tensor block_table, Tensor seq_lens, float scale, "
        "int kv_lora_rank) -> Tensor");
}

TORCH_LIBRARY_IMPL(meshserve_cpu, CPU, m) {
  m.impl("mla_decode_int8", &mla_decode_int8);
  m.impl("mla_decode_bf16", &mla_decode_bf16);
}
TORCH_LIBRARY_IMPL(meshserve_cpu, CatchAll, m) { m.impl("mla_decode_int8_scores_native", &int8_scores_native); }
