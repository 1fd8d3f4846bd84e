// CPU twins of the two per-layer, per-step pieces of auto precision (actnn_zoo/precision):
// the per-sample range statistic (stats.range_statistic) and the width greedy
// (solver.allocate_samples). On the CPU a torch program of ~25 small ops costs more in dispatch
// than the work itself, so each is one call here; on the GPU the statistic stays a torch
// program and the greedy is widths_cuda.cu (its walk shared through widths.h).
//
// range_statistic: one pass per group for min and max (torch needs two: amax, amin); a group
// holding NaN or +-Inf counts 0, as in the torch version. Sums are in double, so values agree
// with torch's float32 reductions to rounding, not bit for bit.
// allocate_widths: bit-identical to solver.allocate_samples for the same float32 scores (same
// float32 gains, same stable order, exact integer prefix sums).

#include "kernels.h"
#include "isa_cpu.h"
#include "widths.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace actnn_zoo {

namespace {

// len * (max - min)^2 of one group, 0 when it holds NaN or +-Inf (v * 0 is NaN exactly for
// those, and a sum holding one NaN is NaN). The lane-wise `a < m ? a : m` is the x86 min
// instruction and never lets NaN into m, so the loop vectorises (omp simd reductions).
template <typename T>
double group_term(const T* __restrict x, int64_t len) {
  float mn = INFINITY, mx = -INFINITY, bad = 0.0f;
#pragma omp simd reduction(min : mn) reduction(max : mx) reduction(+ : bad)
  for (int64_t i = 0; i < len; ++i) {
    const float v = static_cast<float>(x[i]);
    mn = v < mn ? v : mn;
    mx = v > mx ? v : mx;
    bad = bad + v * 0.0f;
  }
  return range_term(mn, mx, std::isnan(bad), len);  // widths.h, shared with the CUDA kernel
}

template <typename T>
void range_rows(const T* x, int64_t n_rows, int64_t d, int64_t group_size, float* out) {
  at::parallel_for(0, n_rows, 1, [&](int64_t begin, int64_t end) {
    run_fast([&] {  // isa_cpu.h; the double sum over groups stays in order on both paths
      for (int64_t n = begin; n < end; ++n) {
        const T* row = x + n * d;
        double acc = 0.0;
        for (int64_t start = 0; start < d; start += group_size) {
          acc += group_term(row + start, std::min(group_size, d - start));
        }
        out[n] = static_cast<float>(acc);
      }
    });
  });
}

}  // namespace

void range_statistic_rows_cpu(const at::Tensor& x, int64_t n_rows, int64_t d,
                              int64_t group_size, float* out) {
  TORCH_CHECK(x.device().is_cpu(), "x must be a CPU tensor");
  TORCH_CHECK(x.is_contiguous() && x.numel() == n_rows * d,
              "x must be contiguous and hold n_rows * d values");
  TORCH_CHECK_VALUE(group_size > 0, "group_size must be positive, got ", group_size);
  if (n_rows == 0) return;
  if (d == 0) {
    std::fill(out, out + n_rows, 0.0f);
    return;
  }
  switch (x.scalar_type()) {
    case at::kFloat: range_rows(x.data_ptr<float>(), n_rows, d, group_size, out); break;
    case at::kHalf: range_rows(x.data_ptr<c10::Half>(), n_rows, d, group_size, out); break;
    case at::kBFloat16:
      range_rows(x.data_ptr<c10::BFloat16>(), n_rows, d, group_size, out);
      break;
    default: TORCH_CHECK(false, "x must be float32, float16 or bfloat16, got ",
                         x.scalar_type());
  }
}

at::Tensor range_statistic_cpu(const at::Tensor& x2d, int64_t group_size) {
  TORCH_CHECK(x2d.dim() == 2, "x2d must be 2-d and contiguous");
  const int64_t n_rows = x2d.size(0), d = x2d.size(1);
  at::Tensor out = at::empty({n_rows}, x2d.options().dtype(at::kFloat));
  range_statistic_rows_cpu(x2d, n_rows, d, group_size, out.data_ptr<float>());
  return out;
}

at::Tensor allocate_widths_cpu(const at::Tensor& score, double extra) {
  TORCH_CHECK(score.device().is_cpu(), "score must be a CPU tensor");
  TORCH_CHECK(score.scalar_type() == at::kFloat && score.dim() == 1 && score.is_contiguous(),
              "score must be a contiguous 1-d float32 tensor");
  const int64_t m = score.size(0);
  // empty, every width written below: at::ones is a fill operator call besides
  at::Tensor out = at::empty({m}, score.options().dtype(at::kByte));
  if (m == 0) return out;
  const float* s = score.data_ptr<float>();
  float gain[3];
  upgrade_gains(gain);
  // The 3m upgrades, stage-major, sorted by gain per bit, descending and stable.
  const int64_t k = 3 * m;
  std::vector<float> ratio(static_cast<size_t>(k));
  for (int stage = 0; stage < 3; ++stage) {
    for (int64_t i = 0; i < m; ++i) ratio[stage * m + i] = gain[stage] * s[i];
  }
  std::vector<int64_t> order(static_cast<size_t>(k));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return ratio[a] > ratio[b]; });
  std::vector<uint8_t> taken(static_cast<size_t>(k), 0);
  allocate_walk(order.data(), m, extra, taken.data());
  uint8_t* w = out.data_ptr<uint8_t>();
  for (int64_t i = 0; i < m; ++i) w[i] = allocated_width(taken.data(), m, i);
  return out;
}

}  // namespace actnn_zoo
