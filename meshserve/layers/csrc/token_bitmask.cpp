// Structured outputs: refuse, in place, the tokens a grammar does not allow (meshserve/worker/grammar_masks.py).
//
// A mask row is llguidance's bitmask, one bit per token (bit t % 32 of int32 word t / 32; 1: allowed). Row i
// of the mask covers logits row rows[i]. A word of all ones is skipped and one of all zeros refuses 32
// tokens in a run, so a JSON grammar's mask (a few allowed tokens in a large vocabulary) costs about one
// store per refused token. Rows are spread over the threads.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>

namespace {

template <typename T>
void refuse_row(T* logits, const int32_t* words, int64_t num_words, int64_t vocab) {
  const T refused = -std::numeric_limits<T>::infinity();
  for (int64_t w = 0; w < num_words; ++w) {
    const uint32_t bits = static_cast<uint32_t>(words[w]);
    if (bits == 0xFFFFFFFFu) continue;
    const int64_t first = w * 32;
    const int64_t end = std::min<int64_t>(first + 32, vocab);
    if (bits == 0) {
      for (int64_t t = first; t < end; ++t) logits[t] = refused;
      continue;
    }
    for (int64_t t = first; t < end; ++t) {
      if (!((bits >> (t - first)) & 1u)) logits[t] = refused;
    }
  }
}

void apply_token_bitmask_(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits must be 2-D with contiguous rows");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.is_contiguous() && bitmask.scalar_type() == at::kInt,
              "the bitmask must be a contiguous int32 [rows, words] tensor");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.size(0) == bitmask.size(0),
              "rows must be int64, one per bitmask row");
  const int64_t vocab = logits.size(1), num_words = bitmask.size(1);
  TORCH_CHECK(num_words * 32 >= vocab, "the bitmask covers ", num_words * 32, " tokens, the logits ", vocab);
  const auto rows_c = rows.contiguous();
  const int64_t* row_ids = rows_c.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows_c.size(0); ++i) {
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < logits.size(0), "row ", row_ids[i], " is outside the logits");
  }
  const int32_t* words = bitmask.data_ptr<int32_t>();
  const int64_t row_stride = logits.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "apply_token_bitmask_", [&] {
    scalar_t* base = logits.data_ptr<scalar_t>();
    at::parallel_for(0, rows_c.size(0), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        refuse_row(base + row_ids[i] * row_stride, words + i * num_words, num_words, vocab);
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(meshserve_cpu, m) {
  m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
}

TORCH_LIBRARY_IMPL(meshserve_cpu, CPU, m) { m.impl("apply_token_bitmask_", &apply_token_bitmask_); }
