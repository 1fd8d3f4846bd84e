// Launch sizes of the grid-stride CUDA kernels (pack_compare, variance, attention dropout,
// widths): one place for the cap. Host code only; included by .cu files.
#pragma once
#include <cstdint>

namespace actnn_zoo {

// Blocks of `threads` covering `items` work items, at least 1 and at most 65535 * 32 (the
// kernels loop over the rest).
inline unsigned grid_stride_blocks(int64_t items, int64_t threads) {
  constexpr int64_t kMaxBlocks = int64_t{65535} * 32;
  const int64_t need = (items + threads - 1) / threads;
  return static_cast<unsigned>(need < 1 ? 1 : (need < kMaxBlocks ? need : kMaxBlocks));
}

}  // namespace actnn_zoo
