// Native CPU kernels for the decode hot spots that library ops serve poorly:
//
// * moe_forward / moe_experts: the routed experts of one MoE layer. At decode batch
//   sizes each expert sees a handful of rows, where a library GEMM call costs more in
//   set-up and thread hand-off than in streaming its weight. Here one parallel region
//   per stage covers every (expert, column block) pair, and the per-row work is a
//   register-tiled broadcast-FMA over a weight packed column-block-major.
//   moe_forward adds the grouping by expert and the weighted combine.
// * grouped_linear: the same tiles for linear layers and MLA's per-head absorption.
// * mla_decode: absorbed MLA decode attention read straight from the paged latent
//   cache, with an online softmax, so the latent is read once and never gathered.
// * rms_norm, rotary_, grouped_topk: one op each instead of several small ones.
//
// Written with GCC vector extensions of the machine's own width (16 floats on AVX-512, 8 on AVX2, 4 on
// NEON or SSE: GCC lowers a wider generic vector than the hardware has through the stack, several times
// slower than scalar code) and built on the machine that runs it (-march=native), so the same source
// compiles anywhere and runs at that machine's width.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "parallel_tasks.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

using meshserve_kernels::combine_parts;
using meshserve_kernels::parallel_tasks;
using meshserve_kernels::split_count;

namespace {

// kLanes floats per vector; a GEMM tile keeps kMaxTileRows rows x one 32-column block of accumulators in
// registers with room for the loads: 32 registers on AVX-512 and NEON, 16 on AVX2 and SSE.
#if defined(__AVX512F__)
constexpr int kLanes = 16, kMaxTileRows = 12, kVectorRegisters = 32;
#elif defined(__AVX__)
constexpr int kLanes = 8, kMaxTileRows = 3, kVectorRegisters = 16;
#elif defined(__ARM_NEON)
constexpr int kLanes = 4, kMaxTileRows = 3, kVectorRegisters = 32;
#else
constexpr int kLanes = 4, kMaxTileRows = 1, kVectorRegisters = 16;
#endif
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int ivec __attribute__((vector_size(kLanes * sizeof(int))));
constexpr int kBlockCols = 32;  // columns of one packed weight block (pack_weight's layout, any width)
constexpr int kBlockVecs = kBlockCols / kLanes;
// Packed weight rows (128 bytes each) fetched ahead, into L2 (prefetcht1): a weight streamed from DRAM this way
// keeps up with oneDNN's sgemv; 2 KB ahead into L1 fell behind it at batch 1.
constexpr int kPrefetchRows = 64;
// Elementwise work (floats touched) below which a loop runs on the calling thread: at decode sizes
// waking the other threads costs more than the work.
constexpr int64_t kSerialWork = 1 << 20;

inline int64_t grain_for(int64_t work_per_item) { return std::max<int64_t>(1, kSerialWork / std::max<int64_t>(1, work_per_item)); }

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(vec));
  return v;
}
inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof(vec)); }
inline vec splat(float s) { return vec{} + s; }

constexpr int64_t kLineFloats = 64 / sizeof(float);
inline float* align_to_line(float* p) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}
inline vec vmax(vec a, vec b) { return a > b ? a : b; }
inline vec vmin(vec a, vec b) { return a < b ? a : b; }

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

// out[m, 0:32] = sum_k x[m, k] * w[k, 0:32] for M rows; w is one packed block [K][32].
template <int M>
void gemm_tile(const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t ldo) {
  vec acc[M][kBlockVecs] = {};
  for (int64_t k = 0; k < K; ++k) {
    __builtin_prefetch(w + (k + kPrefetchRows) * kBlockCols, 0, 2);  // the weight streams once: into L2, ahead
    __builtin_prefetch(w + (k + kPrefetchRows) * kBlockCols + kBlockCols / 2, 0, 2);
    vec wk[kBlockVecs];
#pragma GCC unroll 8
    for (int v = 0; v < kBlockVecs; ++v) wk[v] = load(w + k * kBlockCols + v * kLanes);
#pragma GCC unroll 12
    for (int m = 0; m < M; ++m) {
      const vec s = splat(x[m * ldx + k]);
#pragma GCC unroll 8
      for (int v = 0; v < kBlockVecs; ++v) acc[m][v] += wk[v] * s;
    }
  }
#pragma GCC unroll 12
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
    for (int v = 0; v < kBlockVecs; ++v) store(out + m * ldo + v * kLanes, acc[m][v]);
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t);
template <int... Ms>
constexpr std::array<TileFn, sizeof...(Ms)> tile_table(std::integer_sequence<int, Ms...>) {
  return {&gemm_tile<Ms + 1>...};
}
constexpr auto kTiles = tile_table(std::make_integer_sequence<int, kMaxTileRows>{});

// out[r, 0:32] for rows [0, rows) of x, in tiles of up to kMaxTileRows rows.
void gemm_rows(const float* x, int64_t ldx, int64_t rows, const float* w, int64_t K, float* out, int64_t ldo) {
  for (int64_t r = 0; r < rows; r += kMaxTileRows) {
    const int64_t m = std::min<int64_t>(kMaxTileRows, rows - r);
    kTiles[m - 1](x + r * ldx, ldx, w, K, out + r * ldo, ldo);
  }
}

void check_expert_weights(const at::Tensor& w13, const at::Tensor& w2, int64_t hidden) {
  // w13 [E, 2I/32, H, 32] (gate blocks, then up blocks), w2 [E, H/32, I, 32]: packed by pack_weight.
  TORCH_CHECK(w13.dtype() == at::kFloat && w2.dtype() == at::kFloat, "expert weights must be float32");
  TORCH_CHECK(w13.is_contiguous() && w2.is_contiguous(), "expert weights must be contiguous");
  TORCH_CHECK(w13.dim() == 4 && w2.dim() == 4 && w13.size(3) == kBlockCols && w2.size(3) == kBlockCols,
              "expert weights must be packed in 32-column blocks");
  TORCH_CHECK(w13.size(0) == w2.size(0) && w13.size(2) == hidden && w13.size(1) * kBlockCols == 2 * w2.size(2) &&
                  w2.size(1) * kBlockCols == hidden,
              "expert weight shapes do not match the hidden and intermediate sizes");
}

// ys [R, H] for rows xs [R, H] grouped by expert: expert e owns rows [o[e], o[e + 1]).
at::Tensor run_experts(const at::Tensor& xs, const int64_t* o, const at::Tensor& w13, const at::Tensor& w2) {
  const int64_t num_experts = w13.size(0), hidden = xs.size(1), inter = w2.size(2);
  std::vector<int64_t> active;
  for (int64_t e = 0; e < num_experts; ++e)
    if (o[e + 1] > o[e]) active.push_back(e);
  const int64_t rows = xs.size(0);
  auto act = at::empty({rows, inter}, xs.options());
  auto ys = at::empty({rows, hidden}, xs.options());
  const float* x = xs.data_ptr<float>();
  float* a = act.data_ptr<float>();
  float* y = ys.data_ptr<float>();
  const float* pw13 = w13.data_ptr<float>();
  const float* pw2 = w2.data_ptr<float>();
  const int64_t inter_blocks = inter / kBlockCols, hidden_blocks = hidden / kBlockCols;
  const int64_t w13_expert = 2 * inter * hidden, w2_expert = hidden * inter, block13 = hidden * kBlockCols,
                block2 = inter * kBlockCols;

  // stage 1: act = silu(x Wg^T) * (x Wu^T), one task per (expert, 32 intermediate columns)
  parallel_tasks(static_cast<int64_t>(active.size()) * inter_blocks, [&](int64_t task) {
    float gate[kMaxTileRows * kBlockCols], up[kMaxTileRows * kBlockCols];
    const int64_t e = active[task / inter_blocks], j = task % inter_blocks;
    const float* wg = pw13 + e * w13_expert + j * block13;
    const float* wu = pw13 + e * w13_expert + (inter_blocks + j) * block13;
    for (int64_t r = o[e]; r < o[e + 1]; r += kMaxTileRows) {
      const int64_t m = std::min<int64_t>(kMaxTileRows, o[e + 1] - r);
      kTiles[m - 1](x + r * hidden, hidden, wg, hidden, gate, kBlockCols);
      kTiles[m - 1](x + r * hidden, hidden, wu, hidden, up, kBlockCols);
      for (int64_t i = 0; i < m; ++i)
        for (int h = 0; h < kBlockCols; h += kLanes) {
          const vec g = load(gate + i * kBlockCols + h);
          store(a + (r + i) * inter + j * kBlockCols + h, g / (1.0f + vexp(-g)) * load(up + i * kBlockCols + h));
        }
    }
  });
  // stage 2: ys = act W2^T, one task per (expert, 32 hidden columns)
  parallel_tasks(static_cast<int64_t>(active.size()) * hidden_blocks, [&](int64_t task) {
    const int64_t e = active[task / hidden_blocks], j = task % hidden_blocks;
    gemm_rows(a + o[e] * inter, inter, o[e + 1] - o[e], pw2 + e * w2_expert + j * block2, inter,
              y + o[e] * hidden + j * kBlockCols, hidden);
  });
  return ys;
}

at::Tensor moe_experts(const at::Tensor& xs, const at::Tensor& offsets, const at::Tensor& w13, const at::Tensor& w2) {
  // xs [R, H]: rows grouped by expert, expert e owning rows [offsets[e], offsets[e + 1]).
  TORCH_CHECK(xs.dtype() == at::kFloat && xs.is_contiguous() && xs.dim() == 2, "moe_experts takes float32 rows [R, H]");
  check_expert_weights(w13, w2, xs.size(1));
  const int64_t num_experts = w13.size(0);
  TORCH_CHECK(offsets.dtype() == at::kLong && offsets.numel() == num_experts + 1, "moe_experts: offsets need E + 1 int64");
  const auto off = offsets.contiguous();
  const int64_t* o = off.data_ptr<int64_t>();
  TORCH_CHECK(o[0] == 0 && o[num_experts] == xs.size(0), "moe_experts: offsets do not cover the rows");
  for (int64_t e = 0; e < num_experts; ++e) TORCH_CHECK(o[e + 1] >= o[e], "moe_experts: offsets must not decrease");
  return run_experts(xs, o, w13, w2);
}

at::Tensor moe_forward(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                       int64_t first_slot, const at::Tensor& w13, const at::Tensor& w2) {
  // One MoE layer's routed experts for tokens hidden [T, H] routed to global slots topk_ids [T, K] with
  // weights topk_weights [T, K]: out[t] = sum_k w[t, k] * expert_{ids[t, k]}(hidden[t]) over the slots
  // [first_slot, first_slot + E) held here (others contribute nothing: expert parallelism).
  TORCH_CHECK(hidden.dtype() == at::kFloat && hidden.is_contiguous() && hidden.dim() == 2,
              "moe_forward takes float32 hidden states [T, H]");
  TORCH_CHECK(topk_ids.dtype() == at::kLong && topk_weights.dtype() == at::kFloat && topk_ids.dim() == 2 &&
                  topk_ids.sizes() == topk_weights.sizes() && topk_ids.size(0) == hidden.size(0),
              "moe_forward: topk ids (int64) and weights (float32) must be [T, K]");
  check_expert_weights(w13, w2, hidden.size(1));
  const int64_t tokens = hidden.size(0), top_k = topk_ids.size(1), dim = hidden.size(1), num_experts = w13.size(0);
  const auto ids_c = topk_ids.contiguous();
  const auto wts_c = topk_weights.contiguous();
  const int64_t* ids = ids_c.data_ptr<int64_t>();
  const float* wts = wts_c.data_ptr<float>();
  // stable counting sort of the (token, k) pairs by local expert
  std::vector<int64_t> offsets(num_experts + 1, 0), pair_row(tokens * top_k, -1);
  for (int64_t i = 0; i < tokens * top_k; ++i) {
    const int64_t e = ids[i] - first_slot;
    if (0 <= e && e < num_experts) ++offsets[e + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) offsets[e + 1] += offsets[e];
  const int64_t rows = offsets[num_experts];
  auto out = at::zeros_like(hidden);
  if (rows == 0) return out;
  std::vector<int64_t> cursor(offsets.begin(), offsets.end() - 1), row_token(rows);
  for (int64_t i = 0; i < tokens * top_k; ++i) {
    const int64_t e = ids[i] - first_slot;
    if (0 <= e && e < num_experts) {
      pair_row[i] = cursor[e]++;
      row_token[pair_row[i]] = i / top_k;
    }
  }
  auto xs = at::empty({rows, dim}, hidden.options());
  const float* h = hidden.data_ptr<float>();
  float* x = xs.data_ptr<float>();
  at::parallel_for(0, rows, grain_for(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) std::memcpy(x + r * dim, h + row_token[r] * dim, dim * sizeof(float));
  });
  const auto ys = run_experts(xs, offsets.data(), w13, w2);
  const float* y = ys.data_ptr<float>();
  float* po = out.data_ptr<float>();
  // each token sums its experts' rows in k order
  at::parallel_for(0, tokens, grain_for(top_k * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t k = 0; k < top_k; ++k) {
        const int64_t r = pair_row[t * top_k + k];
        if (r < 0) continue;
        const float w = wts[t * top_k + k];
        float* dst = po + t * dim;
        const float* src = y + r * dim;
        for (int64_t c = 0; c < dim; ++c) dst[c] += w * src[c];
      }
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  // weight * x / sqrt(mean(x^2) + eps) over the last dim, rows in parallel (float32, as the model computes it);
  // x is [rows, dim] with any row stride (a split view of a projection's output) or contiguous
  TORCH_CHECK(x.dtype() == at::kFloat && weight.dtype() == at::kFloat && weight.is_contiguous(),
              "rms_norm takes float32 tensors");
  TORCH_CHECK(x.is_contiguous() || (x.dim() == 2 && x.stride(1) == 1), "rms_norm: rows must be contiguous");
  const int64_t dim = x.size(-1), rows = dim ? x.numel() / dim : 0;
  TORCH_CHECK(weight.numel() == dim, "rms_norm: weight size does not match the last dim");
  const int64_t stride = x.dim() == 2 ? x.stride(0) : dim;
  auto out = at::empty(x.sizes(), x.options());
  const float* px = x.data_ptr<float>();
  const float* pw = weight.data_ptr<float>();
  float* po = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_for(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = px + r * stride;
      vec squares = {};
      int64_t c = 0;
      for (; c + kLanes <= dim; c += kLanes) {
        const vec v = load(row + c);
        squares += v * v;
      }
      float sum = 0.0f;
      for (int i = 0; i < kLanes; ++i) sum += squares[i];
      for (; c < dim; ++c) sum += row[c] * row[c];
      const float inv = 1.0f / std::sqrt(sum / float(dim) + float(eps));
      float* dst = po + r * dim;
      for (int64_t c = 0; c < dim; ++c) dst[c] = pw[c] * (row[c] * inv);
    }
  });
  return out;
}

void rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  // In place, for x [T, R] or [T, H, R] (last dim contiguous, any other strides) and cos/sin [T, R/2]:
  // interleaved pairs (x0, x1), (x2, x3)... rotate together and come out evens-rotated then odds-rotated
  // (HF's apply_rotary_pos_emb_interleave); otherwise the halves rotate (rotate-half layout).
  TORCH_CHECK(x.dtype() == at::kFloat && cos.dtype() == at::kFloat && sin.dtype() == at::kFloat,
              "rotary_ takes float32 tensors");
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1 && x.size(-1) % 2 == 0,
              "rotary_: x must be [T, R] or [T, H, R] with contiguous rows of even length");
  const int64_t tokens = x.size(0), heads = x.dim() == 3 ? x.size(1) : 1, rot = x.size(-1), half = rot / 2;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == tokens * half && sin.numel() == tokens * half,
              "rotary_: cos and sin must be contiguous [T, R/2]");
  const int64_t st = x.stride(0), sh = x.dim() == 3 ? x.stride(1) : 0;
  float* px = x.data_ptr<float>();
  const float* pc = cos.data_ptr<float>();
  const float* ps = sin.data_ptr<float>();
  at::parallel_for(0, tokens, grain_for(heads * rot), [&](int64_t begin, int64_t end) {
    std::vector<float> x1(half), x2(half);
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        float* row = px + t * st + h * sh;
        for (int64_t i = 0; i < half; ++i) {
          x1[i] = interleaved ? row[2 * i] : row[i];
          x2[i] = interleaved ? row[2 * i + 1] : row[half + i];
        }
        const float* c = pc + t * half;
        const float* s = ps + t * half;
        for (int64_t i = 0; i < half; ++i) {
          row[i] = x1[i] * c[i] - x2[i] * s[i];
          row[half + i] = x2[i] * c[i] + x1[i] * s[i];
        }
      }
  });
}

std::tuple<at::Tensor, at::Tensor> grouped_topk(const at::Tensor& logits, const at::Tensor& bias, int64_t top_k,
                                                int64_t n_group, int64_t topk_group, bool norm_topk_prob,
                                                double routed_scaling_factor) {
  // DeepSeek-V3 routing for logits [T, E] (see grouped_topk in deepseek_v3.py): sigmoid scores, experts chosen
  // by biased score within the topk_group best groups (a group scores the sum of its two best biased scores),
  // weighted by their unbiased scores. Returns (weights float32 [T, K], ids int64 [T, K]).
  TORCH_CHECK(logits.dtype() == at::kFloat && bias.dtype() == at::kFloat && logits.dim() == 2,
              "grouped_topk takes float32 logits [T, E] and bias [E]");
  const int64_t tokens = logits.size(0), experts = logits.size(1);
  TORCH_CHECK(bias.numel() == experts && 0 < top_k && top_k <= experts && n_group >= 1 && experts % n_group == 0 &&
                  1 <= topk_group && topk_group <= n_group,
              "grouped_topk: bad sizes");
  const bool limit_groups = n_group > 1 && topk_group < n_group;
  const int64_t group_size = experts / n_group;
  TORCH_CHECK(!limit_groups || group_size >= 2, "grouped_topk: groups need two experts");
  const auto lg = logits.contiguous();
  const auto bs = bias.contiguous();
  auto weights = at::empty({tokens, top_k}, logits.options());
  auto ids = at::empty({tokens, top_k}, logits.options().dtype(at::kLong));
  const float* pl = lg.data_ptr<float>();
  const float* pb = bs.data_ptr<float>();
  float* pwt = weights.data_ptr<float>();
  int64_t* pid = ids.data_ptr<int64_t>();
  at::parallel_for(0, tokens, grain_for(16 * experts), [&](int64_t begin, int64_t end) {
    std::vector<float> scores(experts), choice(experts), group_score(n_group);
    std::vector<char> allowed(n_group);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t e = 0; e < experts; ++e) {
        scores[e] = 1.0f / (1.0f + std::exp(-pl[t * experts + e]));
        choice[e] = scores[e] + pb[e];
      }
      std::fill(allowed.begin(), allowed.end(), 1);
      if (limit_groups) {
        for (int64_t g = 0; g < n_group; ++g) {
          float best = -INFINITY, second = -INFINITY;
          for (int64_t e = g * group_size; e < (g + 1) * group_size; ++e) {
            if (choice[e] > best) {
              second = best;
              best = choice[e];
            } else if (choice[e] > second) {
              second = choice[e];
            }
          }
          group_score[g] = best + second;
        }
        std::fill(allowed.begin(), allowed.end(), 0);
        for (int64_t pick = 0; pick < topk_group; ++pick) {
          int64_t arg = -1;
          for (int64_t g = 0; g < n_group; ++g)
            if (!allowed[g] && (arg < 0 || group_score[g] > group_score[arg])) arg = g;
          allowed[arg] = 1;
        }
      }
      float sum = 0.0f;
      for (int64_t k = 0; k < top_k; ++k) {
        int64_t arg = -1;
        for (int64_t e = 0; e < experts; ++e) {
          if (!allowed[e / group_size] || choice[e] == -INFINITY) continue;
          if (arg < 0 || choice[e] > choice[arg]) arg = e;
        }
        TORCH_CHECK(arg >= 0, "grouped_topk: fewer allowed experts than top_k");
        choice[arg] = -INFINITY;  // taken
        pid[t * top_k + k] = arg;
        pwt[t * top_k + k] = scores[arg];
        sum += scores[arg];
      }
      const float scale = float(routed_scaling_factor) / (norm_topk_prob ? sum + 1e-20f : 1.0f);
      for (int64_t k = 0; k < top_k; ++k) pwt[t * top_k + k] *= scale;
    }
  });
  return {weights, ids};
}

void grouped_linear(const at::Tensor& x, const at::Tensor& w, at::Tensor out) {
  // out[m, g, :] = x[m, g, :] W_g^T for each group g: x [M, G, K], out [M, G, N] (any row strides, last dim
  // contiguous), w [G, N/32, K, 32] packed by pack_weight. MLA decode's per-head absorption products.
  TORCH_CHECK(x.dtype() == at::kFloat && w.dtype() == at::kFloat && out.dtype() == at::kFloat,
              "grouped_linear takes float32 tensors");
  TORCH_CHECK(x.dim() == 3 && out.dim() == 3 && w.dim() == 4 && w.is_contiguous() && w.size(3) == kBlockCols,
              "grouped_linear: x [M, G, K], w [G, N/32, K, 32], out [M, G, N]");
  TORCH_CHECK(x.stride(2) == 1 && out.stride(2) == 1, "grouped_linear: the last dims must be contiguous");
  const int64_t rows = x.size(0), groups = x.size(1), K = x.size(2), blocks = w.size(1);
  TORCH_CHECK(w.size(0) == groups && w.size(2) == K && out.size(0) == rows && out.size(1) == groups &&
                  out.size(2) == blocks * kBlockCols,
              "grouped_linear: shapes do not match");
  const float* px = x.data_ptr<float>();
  const float* pw = w.data_ptr<float>();
  float* po = out.data_ptr<float>();
  const int64_t sx0 = x.stride(0), sx1 = x.stride(1), so0 = out.stride(0), so1 = out.stride(1);
  parallel_tasks(groups * blocks, [&](int64_t task) {
    const int64_t g = task / blocks, j = task % blocks;
    gemm_rows(px + g * sx1, sx0, rows, pw + task * K * kBlockCols, K, po + g * so1 + j * kBlockCols, so0);
  });
}

// Scores of T tokens against one head group: s[t] (lanes = heads) = sum_d qt[d] * kv[t, d].
// kLanes query vectors stay in registers per step of kLanes dims; each token's dims are read from one
// pointer at constant offsets (dim is a multiple of kLanes). Cache lines [pf, pf_end) of the next tile are
// prefetched a few per step: spread over the loop they arrive in time, where one burst of hundreds
// would overflow the miss queues.
template <int T>
void score_tile(const float* qt, const float* kv, int64_t dim, vec* s, const float* pf, const float* pf_end) {
  vec acc[T] = {};
  for (int64_t d0 = 0; d0 < dim; d0 += kLanes) {
    for (int i = 0; i < 8 && pf < pf_end; ++i, pf += kLanes) __builtin_prefetch(pf);
    vec q[kLanes];
#pragma GCC unroll 16
    for (int i = 0; i < kLanes; ++i) q[i] = load(qt + (d0 + i) * kLanes);
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      const float* row = kv + t * dim + d0;
#pragma GCC unroll 16
      for (int i = 0; i < kLanes; ++i) acc[t] += q[i] * row[i];
    }
  }
  for (int t = 0; t < T; ++t) s[t] = acc[t];
}

void score_tail(const float* qt, const float* kv, int64_t dim, int tokens, vec* s) {
  for (int t = 0; t < tokens; ++t) {
    vec acc = {};
    for (int64_t d = 0; d < dim; ++d) acc += load(qt + d * kLanes) * kv[t * dim + d];
    s[t] = acc;
  }
}

// acc[h, c] = acc[h, c] * alpha[h] + sum_t p[t, h] * kv[t, c] over vectors [c0, c0 + N) of the latent,
// for H heads at once (each latent vector loaded once serves every head).
template <int N, int H>
inline void pv_chunk(float* acc, int64_t ld_acc, const float* alpha, const float* probs, const float* kv,
                     int64_t dim, int tokens) {
  vec va[H][N];
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < N; ++i) va[h][i] = load(acc + h * ld_acc + i * kLanes) * alpha[h];
  for (int t = 0; t < tokens; ++t) {
    vec row[N];
    for (int i = 0; i < N; ++i) row[i] = load(kv + t * dim + i * kLanes);
    for (int h = 0; h < H; ++h) {
      const float p = probs[t * kLanes + h];
      for (int i = 0; i < N; ++i) va[h][i] += row[i] * p;
    }
  }
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < N; ++i) store(acc + h * ld_acc + i * kLanes, va[h][i]);
}

// P·c for H consecutive heads: acc rows of kv_lora_rank, probs [t][kLanes heads] starting at the first head.
// A chunk's H x N accumulators and N loaded vectors stay in registers: N = 8 with 32 registers, 4 with 16.
template <int H>
void accumulate_pv(float* acc, int64_t kv_lora_rank, const float* alpha, const float* probs, const float* kv,
                   int64_t dim, int tokens) {
  int64_t c = 0;
  constexpr int kWide = kVectorRegisters >= 32 ? 8 : 4;
  for (; c + kWide * kLanes <= kv_lora_rank; c += kWide * kLanes)
    pv_chunk<kWide, H>(acc + c, kv_lora_rank, alpha, probs, kv + c, dim, tokens);
  for (; c + 4 * kLanes <= kv_lora_rank; c += 4 * kLanes)
    pv_chunk<4, H>(acc + c, kv_lora_rank, alpha, probs, kv + c, dim, tokens);
  for (; c < kv_lora_rank; c += kLanes) pv_chunk<1, H>(acc + c, kv_lora_rank, alpha, probs, kv + c, dim, tokens);
}

at::Tensor mla_decode(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_table,
                      const at::Tensor& seq_lens, double scale, int64_t kv_lora_rank) {
  // q [B, heads, D] (absorbed query: latent part then rope part), cache [blocks, block_size, D],
  // block_table int64 [B, >= blocks per sequence], seq_lens int64 [B] -> P·c [B, heads, kv_lora_rank].
  TORCH_CHECK(q.dtype() == at::kFloat && cache.dtype() == at::kFloat, "mla_decode takes float32 tensors");
  TORCH_CHECK(q.is_contiguous() && cache.is_contiguous(), "mla_decode takes contiguous q and cache");
  TORCH_CHECK(block_table.dtype() == at::kLong && seq_lens.dtype() == at::kLong, "mla_decode takes int64 tables");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), block_size = cache.size(1);
  TORCH_CHECK(cache.size(2) == dim && kv_lora_rank % kLanes == 0 && kv_lora_rank <= dim,
              "mla_decode: cache entry and latent sizes do not match");
  const auto table = block_table.contiguous();
  const auto lens = seq_lens.contiguous();
  const int64_t* bt = table.data_ptr<int64_t>();
  const int64_t* sl = lens.data_ptr<int64_t>();
  const int64_t table_stride = table.size(1);
  auto out = at::empty({batch, heads, kv_lora_rank}, q.options());
  const float* pq = q.data_ptr<float>();
  const float* pc = cache.data_ptr<float>();
  float* po = out.data_ptr<float>();
  const int64_t groups = (heads + kLanes - 1) / kLanes;

  // one task per sequence and head group; where that leaves threads idle (batch 1), each sequence's context is
  // split into parts that run as tasks of their own, their softmax states combined afterwards
  const int64_t splits = split_count(batch * groups, batch ? *std::max_element(sl, sl + batch) : 0);
  const int64_t part_floats = kLanes * kv_lora_rank + 2 * kLanes;  // a part's P·c rows, then m and l
  std::vector<float> parts(splits > 1 ? batch * groups * splits * part_floats : 0);

  parallel_tasks(batch * groups * splits, [&](int64_t task) {
    thread_local std::vector<float> qt_buffer, acc_buffer;  // per thread, reused by its tasks
    // on cache-line boundaries: malloc's 16-byte alignment would split every vector load in two
    qt_buffer.resize(dim * kLanes + kLineFloats);
    acc_buffer.resize(kLanes * kv_lora_rank + kLineFloats);
    float* qt = align_to_line(qt_buffer.data());
    float* acc = align_to_line(acc_buffer.data());
    float probs[kLanes][kLanes], alpha[kLanes];
    vec s[kLanes];
    const int64_t part = task % splits, b = task / splits / groups, h0 = (task / splits % groups) * kLanes;
    const int64_t hg = std::min<int64_t>(kLanes, heads - h0), len = sl[b];
    const int64_t chunk = (len + splits - 1) / splits, begin = std::min(len, part * chunk);
    const int64_t end = std::min(len, begin + chunk);
    // the group's query, transposed to [D][kLanes heads] and scaled (padding heads are zero)
    std::fill(qt, qt + dim * kLanes, 0.0f);
    for (int64_t h = 0; h < hg; ++h)
      for (int64_t d = 0; d < dim; ++d) qt[d * kLanes + h] = pq[(b * heads + h0 + h) * dim + d] * float(scale);
    std::fill(acc, acc + kLanes * kv_lora_rank, 0.0f);
    vec m = splat(-FLT_MAX), l = {};
    int tokens = 0;
    for (int64_t t0 = begin; t0 < end; t0 += tokens) {
      // a tile is up to kLanes tokens of one block
      const int64_t block = bt[b * table_stride + t0 / block_size], in_block = t0 % block_size;
      tokens = static_cast<int>(std::min({int64_t(kLanes), end - t0, block_size - in_block}));
      const float* kv = pc + (block * block_size + in_block) * dim;
      const int64_t next = t0 + tokens;
      const float* nkv = nullptr;
      int64_t n = 0;
      if (next < end) {  // the next tile's entries stream in while this one computes (see score_tile)
        nkv = pc + (bt[b * table_stride + next / block_size] * block_size + next % block_size) * dim;
        n = std::min({int64_t(kLanes), end - next, block_size - next % block_size}) * dim;
      }
      if (tokens == kLanes && dim % kLanes == 0) {
        const float* mid = nkv + std::min(n, int64_t(kLanes / 2) * dim);
        score_tile<kLanes / 2>(qt, kv, dim, s, nkv, mid);
        score_tile<kLanes / 2>(qt, kv + kLanes / 2 * dim, dim, s + kLanes / 2, mid, nkv + n);
      } else {
        for (int64_t i = 0; i < n; i += kLanes) __builtin_prefetch(nkv + i);
        score_tail(qt, kv, dim, tokens, s);
      }
      vec tile_max = s[0];
      for (int t = 1; t < tokens; ++t) tile_max = vmax(tile_max, s[t]);
      const vec m_new = vmax(m, tile_max);
      const vec rescale = vexp(m - m_new);
      l *= rescale;
      for (int t = 0; t < tokens; ++t) {
        const vec p = vexp(s[t] - m_new);
        l += p;
        store(probs[t], p);
      }
      m = m_new;
      store(alpha, rescale);
      int64_t h = 0;
      for (; h + 2 <= hg; h += 2) accumulate_pv<2>(acc + h * kv_lora_rank, kv_lora_rank, alpha + h,
                                                   &probs[0][h], kv, dim, tokens);
      if (h < hg) accumulate_pv<1>(acc + h * kv_lora_rank, kv_lora_rank, alpha + h, &probs[0][h], kv, dim,
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

// Splitting a decode sequence's context over the threads (mla_decode here, mla_decode_int8 in kv_int8.cpp; both
// files are built with the same flags, so kLanes is the same in both).
namespace meshserve_kernels {
constexpr int64_t kMinSplitTokens = 128;  // a context part shorter than this is not worth its combine
constexpr int64_t kMaxSplits = 64;

// Parts each sequence's context is split into: enough to give every thread a task, none shorter than
// kMinSplitTokens; 1 where the sequences and head groups already give every thread one.
int64_t split_count(int64_t tasks, int64_t max_len) {
  const int64_t threads = at::get_num_threads();
  if (tasks == 0 || tasks >= threads) return 1;
  return std::clamp<int64_t>(max_len / kMinSplitTokens, 1, std::min(kMaxSplits, (threads + tasks - 1) / tasks));
}

// out[b, h] from the `splits` parts of each (sequence, head group): each part holds its unnormalized P·c rows
// [kLanes][c], then its running max m and sum l per head lane; parts are rescaled to the largest max.
void combine_parts(const float* parts, int64_t splits, int64_t num_groups, int64_t groups, int64_t heads, int64_t c,
                   float* out) {
  const int64_t part_floats = kLanes * c + 2 * kLanes;
  for (int64_t bg = 0; bg < num_groups; ++bg) {
    const int64_t b = bg / groups, h0 = (bg % groups) * kLanes, hg = std::min<int64_t>(kLanes, heads - h0);
    const float* state = parts + bg * splits * part_floats;
    for (int64_t h = 0; h < hg; ++h) {
      float top = -FLT_MAX, sum = 0.0f, weight[kMaxSplits];
      for (int64_t k = 0; k < splits; ++k) top = std::max(top, state[k * part_floats + kLanes * c + h]);
      for (int64_t k = 0; k < splits; ++k) {
        weight[k] = std::exp(state[k * part_floats + kLanes * c + h] - top);
        sum += weight[k] * state[k * part_floats + kLanes * c + kLanes + h];
      }
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      float* dst = out + (b * heads + h0 + h) * c;
      for (int64_t i = 0; i < c; ++i) {
        float value = 0.0f;
        for (int64_t k = 0; k < splits; ++k) value += weight[k] * state[k * part_floats + h * c + i];
        dst[i] = value * inv;
      }
    }
  }
}
}  // namespace meshserve_kernels

// The kernels above as the fused decode layer calls them (decode_layer.cpp), without the dispatcher.
namespace meshserve_kernels {
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) { return ::rms_norm(x, weight, eps); }
void rotary(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  ::rotary_(x, cos, sin, interleaved);
}
std::tuple<at::Tensor, at::Tensor> grouped_topk(const at::Tensor& logits, const at::Tensor& bias, int64_t top_k,
                                                int64_t n_group, int64_t topk_group, bool norm_topk_prob,
                                                double routed_scaling_factor) {
  return ::grouped_topk(logits, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor);
}
void grouped_linear(const at::Tensor& x, const at::Tensor& w, at::Tensor out) { ::grouped_linear(x, w, out); }
at::Tensor moe_forward(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                       int64_t first_slot, const at::Tensor& w13, const at::Tensor& w2) {
  return ::moe_forward(hidden, topk_ids, topk_weights, first_slot, w13, w2);
}
at::Tensor mla_decode(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_table,
                      const at::Tensor& seq_lens, double scale, int64_t kv_lora_rank) {
  return ::mla_decode(q, cache, block_table, seq_lens, scale, kv_lora_rank);
}
}  // namespace meshserve_kernels

TORCH_LIBRARY(meshserve_cpu, m) {
  m.def("moe_experts(Tensor xs, Tensor offsets, Tensor w13, Tensor w2) -> Tensor");
  m.def("moe_forward(Tensor hidden, Tensor topk_ids, Tensor topk_weights, int first_slot, Tensor w13, Tensor w2) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin, bool interleaved) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("grouped_topk(Tensor logits, Tensor bias, int top_k, int n_group, int topk_group, bool norm_topk_prob, float routed_scaling_factor) -> (Tensor, Tensor)");
  m.def("grouped_linear(Tensor x, Tensor w, Tensor(a!) out) -> ()");
  m.def("mla_decode(Tensor q, Tensor cache, Tensor block_table, Tensor seq_lens, float scale, int kv_lora_rank) -> Tensor");
}

TORCH_LIBRARY_IMPL(meshserve_cpu, CPU, m) {
  m.impl("moe_experts", &moe_experts);
  m.impl("mla_decode", &mla_decode);
  m.impl("grouped_linear", &grouped_linear);
  m.impl("moe_forward", &moe_forward);
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary_", &rotary_);
  m.impl("grouped_topk", &grouped_topk);
}
