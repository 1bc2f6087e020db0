// Work sharing of the native kernels (cpu_kernels.cpp, kv_int8.cpp, bf16_kernels.cpp), and the split of a decode
// sequence's context over the threads that both MLA decode kernels use.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace meshserve_kernels {

// Runs task(i) for i in [0, n) on torch's threads. Each thread works through its own contiguous share
// (weights stream in address order), then helps with what is left of the others' shares: on a machine
// where other processes take a core now and then, a delayed thread's work moves to the others instead
// of holding everyone at the end of the region.
template <typename Task>
void parallel_tasks(int64_t n, const Task& task) {
  if (n <= 0) return;
  const int64_t shares = std::min<int64_t>(n, at::get_num_threads());
  std::vector<std::atomic<int64_t>> next(shares);
  for (int64_t k = 0; k < shares; ++k) next[k].store(k * n / shares, std::memory_order_relaxed);
  at::parallel_for(0, shares, 1, [&](int64_t begin, int64_t) {
    for (int64_t d = 0; d < shares; ++d) {
      const int64_t k = (begin + d) % shares, end = (k + 1) * n / shares;
      for (int64_t i = next[k].fetch_add(1, std::memory_order_relaxed); i < end;
           i = next[k].fetch_add(1, std::memory_order_relaxed))
        task(i);
    }
  });
}

// Parts each sequence's context is split into, and their softmax states combined (defined in cpu_kernels.cpp).
int64_t split_count(int64_t tasks, int64_t max_len);
void combine_parts(const float* parts, int64_t splits, int64_t num_groups, int64_t groups, int64_t heads, int64_t c,
                   float* out);

}  // namespace meshserve_kernels
