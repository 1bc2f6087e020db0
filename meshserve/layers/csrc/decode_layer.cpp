// A DeepSeek-V3 decoder layer's decode step in two native calls (meshserve/models/fused_decode.py).
//
// At batch 1 a layer is about forty small ops; from Python each costs a few microseconds of interpreter and
// dispatcher around a kernel that itself takes a few, so a step spent a third of its time between kernels.
// Here the same kernels (cpu_kernels.cpp, int8_kernels.cpp) run in the same order on the same tensors,
// called directly: the MLA attention half (norms, projections, RoPE, the cache write, absorbed attention,
// o_proj, the residual) and the MLP half (routing, routed and shared experts, or a dense MLP, the residual).
// The results are the unfused path's, to the float rounding of the same kernels.
//
// A linear's weights come as three tensors: a float32 one packed for grouped_linear and two empty ones, or
// an INT8 one as int8_linear takes it (blocks, compensation, scales), or a bfloat16 one packed for bf16_linear,
// or (a shape the native kernels do not pack) the plain [N, K] weight and two empty ones. A bfloat16 model's rows
// stay float32 here; each bfloat16 linear rounds its input to bfloat16 (as the model's own layers do), its cache
// entries are rounded once when written, and its attention reads the bfloat16 cache (mla_decode_bf16).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>
#include <tuple>
#include <vector>

namespace meshserve_kernels {
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void rotary(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved);
std::tuple<at::Tensor, at::Tensor> grouped_topk(const at::Tensor& logits, const at::Tensor& bias, int64_t top_k,
                                                int64_t n_group, int64_t topk_group, bool norm_topk_prob,
                                                double routed_scaling_factor);
void grouped_linear(const at::Tensor& x, const at::Tensor& w, at::Tensor out);
at::Tensor moe_forward(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                       int64_t first_slot, const at::Tensor& w13, const at::Tensor& w2);
at::Tensor mla_decode(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_table,
                      const at::Tensor& seq_lens, double scale, int64_t kv_lora_rank);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& comp, const at::Tensor& scale);
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w);
at::Tensor mla_decode_bf16(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_table,
                           const at::Tensor& seq_lens, double scale, int64_t kv_lora_rank);
at::Tensor int8_moe_forward(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                            int64_t first_slot, const at::Tensor& w13, const at::Tensor& w13_comp,
                            const at::Tensor& w13_scale, const at::Tensor& w2, const at::Tensor& w2_comp,
                            const at::Tensor& w2_scale);
}  // namespace meshserve_kernels

namespace {

namespace mk = meshserve_kernels;

constexpr int64_t kLinear = 3;  // tensors per linear

// x [M, K] (last dim contiguous) through the linear whose tensors start at w[i] -> [M, N]
at::Tensor linear(const at::Tensor& x, at::TensorList w, int64_t i) {
  const at::Tensor& weight = w[i];
  if (weight.scalar_type() == at::kFloat && weight.dim() == 2) return at::linear(x, weight);  // not packable
  if (weight.scalar_type() == at::kBFloat16) {  // a bfloat16 model's: its input rounded as its own layers would
    auto rounded = x.to(at::kBFloat16);
    return (weight.dim() == 2 ? at::linear(rounded, weight) : mk::bf16_linear(rounded, weight)).to(at::kFloat);
  }
  if (weight.scalar_type() == at::kFloat) {  // [1, N/32, K, 32]
    const int64_t n = weight.size(1) * weight.size(3);
    auto out = at::empty({x.size(0), 1, n}, x.options());
    mk::grouped_linear(x.unsqueeze(1), weight, out);
    return out.view({x.size(0), n});
  }
  return mk::int8_linear(x, weight, w[i + 1], w[i + 2]);
}

// silu(x W_gate^T) * (x W_up^T) W_down^T: gate/up one linear at w[i], down the next
at::Tensor swiglu(const at::Tensor& x, at::TensorList w, int64_t i) {
  auto gate_up = linear(x, w, i);
  const int64_t inter = gate_up.size(1) / 2;
  auto act = at::silu(gate_up.narrow(1, 0, inter)).mul_(gate_up.narrow(1, inter, inter));
  return linear(act, w, i + kLinear);
}

// cache rows slots[b] = [latent[b], k_pe[b]]: a row copy each (at::cat and index_copy_ cost more to set up
// than the copies at decode sizes)
void write_cache_entries(const at::Tensor& cache, const at::Tensor& slots, const at::Tensor& latent,
                         const at::Tensor& k_pe) {
  const int64_t c = latent.size(1), rope = k_pe.size(1), width = c + rope, rows = cache.numel() / width;
  if (cache.scalar_type() == at::kBFloat16) {  // a bfloat16 model's cache: each entry rounded once, here
    cache.view({rows, width}).index_copy_(0, slots, at::cat({latent, k_pe}, 1).to(at::kBFloat16));
    return;
  }
  TORCH_CHECK(cache.is_contiguous() && cache.dtype() == at::kFloat && slots.dtype() == at::kLong &&
                  slots.numel() == latent.size(0) && latent.is_contiguous() && k_pe.stride(1) == 1,
              "mla_decode_attention: the cache write takes a float32 cache and int64 slots");
  const int64_t* slot = slots.data_ptr<int64_t>();
  float* base = cache.data_ptr<float>();
  for (int64_t b = 0; b < slots.numel(); ++b) {
    TORCH_CHECK(slot[b] >= 0 && slot[b] < rows, "mla_decode_attention: slot ", slot[b], " is outside the cache");
    float* row = base + slot[b] * width;
    std::memcpy(row, latent.data_ptr<float>() + b * c, c * sizeof(float));
    std::memcpy(row + c, k_pe.data_ptr<float>() + b * k_pe.stride(0), rope * sizeof(float));
  }
}

// hidden [B, hidden] of B one-token decode rows -> hidden + MLA attention.
// w: input norm, fused q_a/kv_a (3), q_a norm, q_b (3), kv_a norm, W_UK packed, W_UV packed, o_proj (3).
// dims: heads, nope, rope, kv_lora_rank, v, q input width, interleaved RoPE, has q_lora.
// f: input norm eps, q_a norm eps, kv_a norm eps, softmax scale.
at::Tensor mla_decode_attention(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                                const at::Tensor& cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                                const at::Tensor& slots, at::TensorList w, at::IntArrayRef dims,
                                at::ArrayRef<double> f) {
  TORCH_CHECK(w.size() == 14 && dims.size() == 8 && f.size() == 4,
              "mla_decode_attention: 14 weights, 8 dims, 4 floats");
  TORCH_CHECK(hidden.dtype() == at::kFloat && hidden.dim() == 2 && hidden.is_contiguous(),
              "mla_decode_attention takes float32 hidden states [B, hidden]");
  const int64_t heads = dims[0], nope = dims[1], rope = dims[2], c = dims[3], v = dims[4], q_in = dims[5];
  const bool interleaved = dims[6] != 0, q_lora = dims[7] != 0;
  const int64_t batch = hidden.size(0);
  auto qkv = linear(mk::rms_norm(hidden, w[0], f[0]), w, 1);  // [B, q_in + c + rope]
  auto q = q_lora ? linear(mk::rms_norm(qkv.narrow(1, 0, q_in), w[4], f[1]), w, 5)
                  : qkv.narrow(1, 0, q_in).contiguous();
  q = q.view({batch, heads, nope + rope});
  auto k_pe = qkv.narrow(1, q_in + c, rope);
  mk::rotary(q.narrow(2, nope, rope), cos, sin, interleaved);
  mk::rotary(k_pe, cos, sin, interleaved);
  write_cache_entries(cache, slots, mk::rms_norm(qkv.narrow(1, q_in, c), w[8], f[2]), k_pe);
  auto q_full = at::empty({batch, heads, c + rope}, hidden.options());
  mk::grouped_linear(q.narrow(2, 0, nope), w[9], q_full.narrow(2, 0, c));
  q_full.narrow(2, c, rope).copy_(q.narrow(2, nope, rope));
  auto latent = cache.scalar_type() == at::kBFloat16
                    ? mk::mla_decode_bf16(q_full, cache, block_table, seq_lens, f[3], c)
                    : mk::mla_decode(q_full, cache, block_table, seq_lens, f[3], c);
  auto out = at::empty({batch, heads, v}, hidden.options());
  mk::grouped_linear(latent, w[10], out);
  return hidden + linear(out.view({batch, heads * v}), w, 11);
}

// A bfloat16 model's routed experts: sum_k w[t, k] * expert_{ids[t, k]}(x[t]) over the local slots [first_slot,
// first_slot + E), each active expert's rows through its two packed bfloat16 linears (w13 [E, 2I/32, H/2, 32, 2],
// w2 [E, H/32, I/2, 32, 2]); x and the result in float32.
at::Tensor bf16_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, int64_t first_slot,
                        const at::Tensor& w13, const at::Tensor& w2) {
  const int64_t tokens = ids.size(0), top_k = ids.size(1), num_experts = w13.size(0);
  const auto flat_ids = ids.contiguous();
  const auto flat_weights = weights.to(at::kFloat).contiguous();
  const int64_t* pid = flat_ids.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> rows(num_experts), pairs(num_experts);
  for (int64_t i = 0; i < tokens * top_k; ++i) {
    const int64_t e = pid[i] - first_slot;
    if (0 <= e && e < num_experts) {
      rows[e].push_back(i / top_k);
      pairs[e].push_back(i);
    }
  }
  auto out = at::zeros_like(x);
  const auto all_weights = flat_weights.view({-1});
  for (int64_t e = 0; e < num_experts; ++e) {
    if (rows[e].empty()) continue;
    const auto index = at::tensor(rows[e], x.options().dtype(at::kLong));
    auto gate_up = mk::bf16_linear(x.index_select(0, index).to(at::kBFloat16), w13[e]).to(at::kFloat);
    const int64_t inter = gate_up.size(1) / 2;
    auto act = at::silu(gate_up.narrow(1, 0, inter)).mul_(gate_up.narrow(1, inter, inter));
    auto y = mk::bf16_linear(act.to(at::kBFloat16), w2[e]).to(at::kFloat);
    const auto scale = all_weights.index_select(0, at::tensor(pairs[e], x.options().dtype(at::kLong)));
    out.index_add_(0, index, y.mul_(scale.unsqueeze(1)));
  }
  return out;
}

// hidden [B, hidden] -> hidden + MLP(post-attention norm(hidden)).
// Dense (dims[0] == 0): w = norm, gate/up (3), down (3).
// MoE: w = norm, router (3), correction bias, experts (6: float32 w13, w2 packed and four empty tensors, or
// INT8 w13 blocks, compensation, scales, then w2's), shared gate/up (3), shared down (3) where
// there are shared experts; dims: 1, top_k, n_group, topk_group, norm_topk_prob, first slot, has shared
// experts; f: norm eps, routed scaling factor. `load_counts` (int64 [E]) counts the routed tokens per expert.
at::Tensor decoder_mlp(const at::Tensor& hidden, at::TensorList w, at::IntArrayRef dims, at::ArrayRef<double> f,
                       const c10::optional<at::Tensor>& load_counts) {
  TORCH_CHECK(!dims.empty() && !f.empty(), "decoder_mlp: dims and floats");
  auto x = mk::rms_norm(hidden, w[0], f[0]);
  if (dims[0] == 0) {
    TORCH_CHECK(w.size() == 7, "decoder_mlp: a dense MLP takes 7 weights");
    return hidden + swiglu(x, w, 1);
  }
  TORCH_CHECK(dims.size() == 7 && f.size() == 2 && w.size() == (dims[6] ? 17u : 11u),
              "decoder_mlp: a MoE layer takes 7 dims, 2 floats and 11 weights (17 with shared experts)");
  auto [weights, ids] = mk::grouped_topk(linear(x, w, 1), w[4], dims[1], dims[2], dims[3], dims[4] != 0, f[1]);
  if (load_counts.has_value() && load_counts->defined()) {
    auto flat = ids.reshape({-1});
    load_counts->index_add_(0, flat, at::ones({flat.numel()}, load_counts->options()));
  }
  auto routed = w[5].scalar_type() == at::kFloat      ? mk::moe_forward(x, ids, weights, dims[5], w[5], w[6])
                : w[5].scalar_type() == at::kBFloat16 ? bf16_experts(x, ids, weights, dims[5], w[5], w[6])
                                                      : mk::int8_moe_forward(x, ids, weights, dims[5], w[5], w[6],
                                                                             w[7], w[8], w[9], w[10]);
  if (dims[6]) routed = routed + swiglu(x, w, 11);
  return hidden + routed;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(meshserve_cpu, m) {
  m.def("mla_decode_attention(Tensor hidden, Tensor cos, Tensor sin, Tensor(a!) cache, Tensor block_table, "
        "Tensor seq_lens, Tensor slots, Tensor[] w, int[] dims, float[] f) -> Tensor");
  m.def("decoder_mlp(Tensor hidden, Tensor[] w, int[] dims, float[] f, Tensor(b!)? load_counts) -> Tensor");
}

TORCH_LIBRARY_IMPL(meshserve_cpu, CPU, m) {
  m.impl("mla_decode_attention", &mla_decode_attention);
  m.impl("decoder_mlp", &decoder_mlp);
}
