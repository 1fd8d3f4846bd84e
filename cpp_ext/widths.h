// The width greedy of auto precision (precision/solver.py, allocate_samples), the part the CPU
// loop (widths_cpu.cpp) and the CUDA kernel (widths_cuda.cu) share: after the 3m upgrades
// (1->2 of every item, then 2->4, then 4->8: stage-major) are ordered by gain per bit,
// descending and stable, take the prefix whose costs fit in `extra` bits, then the 1->2
// upgrades left out of it, in the same order, while bits remain; an item's width is 1 plus the
// costs of its upgrades taken. Integer costs, exact prefix sums, compared with the budget in
// double, as the torch program's float32 cumsum of small integers is exact.
#pragma once
#include "bf16.h"  // AZ_HD

#include <cstdint>

namespace actnn_zoo {

// One group's term of the range statistic (precision/stats.py, range_statistic): len * (max -
// min)^2 with the square in float32, as the torch version takes it, summed by the caller in
// double in group order; 0 for a group holding NaN or +-Inf (`bad`) or whose square overflows.
// The min and max are exact whatever order a device reads the values in, so CPU and CUDA give
// the same terms, and the same sums.
AZ_HD double range_term(float mn, float mx, bool bad, int64_t len) {
  const float r = fsub(mx, mn);
  const float r2 = fmul(r, r);
  if (bad || (float_bits(r2) & 0x7F800000u) == 0x7F800000u) return 0.0;
  return static_cast<double>(len) * static_cast<double>(r2);
}

// Bits the upgrade of stage 0, 1, 2 (1->2, 2->4, 4->8) adds to one item: 1, 2, 4
// (solver.UPGRADE_COST).
AZ_HD int64_t upgrade_cost(int64_t stage) { return int64_t{1} << stage; }

// Gain per bit of the upgrades 1->2, 2->4, 4->8 as solver.UpgradeTable builds them: float64
// (v(b) - v(b')) / cost with v(b) = 1 / (2^b - 1)^2, then rounded to float32.
inline void upgrade_gains(float gain[3]) {
  auto v = [](int b) { const double l = static_cast<double>((1 << b) - 1); return 1.0 / (l * l); };
  gain[0] = static_cast<float>((v(1) - v(2)) / 1.0);
  gain[1] = static_cast<float>((v(2) - v(4)) / 2.0);
  gain[2] = static_cast<float>((v(4) - v(8)) / 4.0);
}

// taken[u] (zeroed by the caller) for the upgrades in `order` (a permutation of [0, 3m)).
template <typename I>
AZ_HD void allocate_walk(const I* order, int64_t m, double extra, uint8_t* taken) {
  const int64_t k = 3 * m;
  int64_t spent = 0, cum = 0;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t u = static_cast<int64_t>(order[j]);
    cum += upgrade_cost(u / m);
    if (static_cast<double>(cum) > extra) break;
    taken[u] = 1;
    spent = cum;
  }
  const double left = extra - static_cast<double>(spent);
  int64_t units = 0;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t u = static_cast<int64_t>(order[j]);
    if (u >= m || taken[u]) continue;  // only untaken 1->2 upgrades cost 1 bit
    ++units;
    if (static_cast<double>(units) > left) break;
    taken[u] = 1;
  }
}

// The width of item i from its three upgrades' flags.
AZ_HD uint8_t allocated_width(const uint8_t* taken, int64_t m, int64_t i) {
  return static_cast<uint8_t>(1 + taken[i] + 2 * taken[m + i] + 4 * taken[2 * m + i]);
}

}  // namespace actnn_zoo
