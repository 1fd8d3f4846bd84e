// Page backing of large kernel outputs, shared by the quantizer (quant_cpu.cpp) and sparse codes
// (sparse_cpu.cpp).
#pragma once
#include <cstdint>
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace actnn_zoo {

// A freshly allocated output of tens of MiB is first touched by our stores, and on Linux every
// 4 KiB page costs a fault that zeroes it: for a 64 MiB dequantize that is ~16K faults, 3-4x the
// time of the stores themselves (the kernel runs at copy_ bandwidth into touched memory). Asking
// for transparent huge pages on the 2 MiB-aligned interior of the buffer (what torch does for
// every allocation under THP_MEM_ALLOC_ENABLE=1, here only for our own outputs) makes that 32
// faults. Advice only: where THP is off or no huge page is free the kernel falls back to 4 KiB
// pages, and memory already touched is left as it is. Outputs are written completely, so no
// huge page is backed by memory nobody uses.
constexpr int64_t kHugePage = int64_t{1} << 21;
constexpr int64_t kAdviseMin = int64_t{4} << 20;  // smaller buffers: not worth a syscall

inline void advise_huge_pages(void* ptr, int64_t nbytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (nbytes < kAdviseMin) return;
  const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
  const uintptr_t begin = (p + kHugePage - 1) & ~static_cast<uintptr_t>(kHugePage - 1);
  const uintptr_t end = (p + static_cast<uintptr_t>(nbytes)) & ~static_cast<uintptr_t>(kHugePage - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);  // best effort
#else
  (void)ptr;
  (void)nbytes;
#endif
}

}  // namespace actnn_zoo
