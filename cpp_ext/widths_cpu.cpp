// CPU twins of the two per-layer, per-step pieces of auto precision (actnn_zoo/precision):
// the per-sample range statistic (stats.range_statistic) and the width greedy
// (solver.allocate_samples). On the GPU these stay torch programs; on the CPU a torch program
// of ~25 small ops costs more in dispatch than the work itself, so each is one call here.
//
// range_statistic: one pass per group for min and max (torch needs two: amax, amin); a group
// holding NaN or +-Inf counts 0, as in the torch version. Sums are in double, so values agree
// with torch's float32 reductions to rounding, not bit for bit.
// allocate_widths: bit-identical to solver.allocate_samples for the same float32 scores (same
// float32 gains, same stable order, exact integer prefix sums).

#include "kernels.h"
#include "isa_cpu.h"

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
  const float r = mx - mn;
  const float r2 = r * r;  // squared in float32, as the torch version does
  if (std::isnan(bad) || !std::isfinite(r2)) return 0.0;
  return static_cast<double>(len) * static_cast<double>(r2);
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
  // empty, then every width set to 1 here: at::ones is a fill operator call besides
  at::Tensor out = at::empty({m}, score.options().dtype(at::kByte));
  if (m == 0) return out;
  std::fill(out.data_ptr<uint8_t>(), out.data_ptr<uint8_t>() + m, uint8_t{1});
  const float* s = score.data_ptr<float>();
  // Gain per bit of the upgrades 1->2, 2->4, 4->8 as solver.UpgradeTable builds them: float64
  // (v(b) - v(b')) / cost, then rounded to float32.
  auto v = [](int b) { const double l = static_cast<double>((1 << b) - 1); return 1.0 / (l * l); };
  const int cost[3] = {1, 2, 4};
  const float gain[3] = {static_cast<float>((v(1) - v(2)) / 1.0),
                         static_cast<float>((v(2) - v(4)) / 2.0),
                         static_cast<float>((v(4) - v(8)) / 4.0)};
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
  // The prefix whose costs fit in `extra`, then 1->2 upgrades left out of it, in the same
  // order, while bits remain.
  std::vector<uint8_t> taken(static_cast<size_t>(k), 0);
  int64_t spent = 0, cum = 0;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t u = order[j];
    cum += cost[u / m];
    if (static_cast<double>(cum) > extra) break;
    taken[u] = 1;
    spent = cum;
  }
  const double left = extra - static_cast<double>(spent);
  int64_t units = 0;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t u = order[j];
    if (u >= m || taken[u]) continue;  // only untaken 1->2 upgrades cost 1 bit
    ++units;
    if (static_cast<double>(units) > left) break;
    taken[u] = 1;
  }
  uint8_t* w = out.data_ptr<uint8_t>();
  for (int64_t u = 0; u < k; ++u) {
    if (taken[u]) w[u % m] = static_cast<uint8_t>(w[u % m] + cost[u / m]);
  }
  return out;
}

}  // namespace actnn_zoo
