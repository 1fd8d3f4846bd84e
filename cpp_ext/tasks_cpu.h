// Dynamic work splitting for the CPU kernels (quantizer, masks, sparse codes).
#pragma once
#include "isa_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace actnn_zoo {

// f(begin, end) over [0, total) in tasks of `grain` items, handed out dynamically over
// torch's thread count. Unlike at::parallel_for's one static slice per thread, a thread that
// starts late (a busy machine: the OS runs something else on that core for a time slice)
// does not hold up the others, which take over its tasks. Items are independent, so the
// result does not depend on who runs what.
// Each task runs through run_fast (isa_cpu.h): on an AVX2 CPU its loops are the AVX2 copy.
template <typename F>
void parallel_tasks(int64_t total, int64_t grain, const F& f) {
  if (total <= 0) return;
  const int64_t tasks = (total + grain - 1) / grain;
  auto task = [&f](int64_t begin, int64_t end) { run_fast([&] { f(begin, end); }); };
#ifdef _OPENMP
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), tasks));
  if (threads > 1 && !omp_in_parallel()) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t t = 0; t < tasks; ++t) task(t * grain, std::min(total, (t + 1) * grain));
    return;
  }
#endif
  at::parallel_for(0, total, grain, task);
}

}  // namespace actnn_zoo
