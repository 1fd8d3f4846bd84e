// DIVISION's argument checks, shared by the CPU and CUDA entries (division_cpu.cpp,
// division_cuda.cu): shapes, dtypes and layouts only, read from the tensors' metadata, so they
// cost no device read on CUDA. The per-row widths and offsets are values: the CPU entry checks
// them as well (check_rows there); on CUDA they stay on the device and ACTNN_ZOO_DEBUG=1 checks
// them on the host first (actnn_zoo.quant.api), as for quant_cuda.cu.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace actnn_zoo {
namespace division_checks {

// A (N, C, D1, D2, D3) map tensor the kernels read or write whole.
inline void check_x5(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 5, name, " must be 5-d (N, C, D1, D2, D3), got shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  const auto st = t.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kHalf || st == at::kBFloat16, name,
              " must be float32, float16 or bfloat16, got ", st);
}

// One width per sample (uint8, N) and the byte offset of each row (int64, N + 1).
inline void check_row_layout(const at::Tensor& bits, const at::Tensor& offsets, int64_t n) {
  TORCH_CHECK(bits.scalar_type() == at::kByte && bits.dim() == 1 && bits.size(0) == n &&
                  bits.is_contiguous(),
              "bits must be a contiguous (N,) uint8 tensor, N = ", n);
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1 &&
                  offsets.size(0) == n + 1 && offsets.is_contiguous(),
              "offsets must be a contiguous (N + 1,) int64 tensor, N = ", n);
}

// What dequantize reads besides the rows: codes, per-map range (float32) and step (bfloat16),
// and, with a low part, one bfloat16 mean per block of each map.
inline void check_payload(const at::Tensor& data, const at::Tensor& low, const at::Tensor& lo,
                          const at::Tensor& step, bool has_low, int64_t maps, int64_t blocks) {
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 1 && data.is_contiguous(),
              "data must be a contiguous 1-d uint8 tensor");
  TORCH_CHECK(lo.scalar_type() == at::kFloat && lo.numel() == maps && lo.is_contiguous(),
              "lo must be a contiguous float32 (N, C) tensor");
  TORCH_CHECK(step.scalar_type() == at::kBFloat16 && step.numel() == maps &&
                  step.is_contiguous(),
              "step must be a contiguous bfloat16 (N, C) tensor");
  if (has_low) {
    TORCH_CHECK(low.scalar_type() == at::kBFloat16 && low.is_contiguous() &&
                    low.numel() == maps * blocks,
                "low must be a contiguous bfloat16 tensor of ", maps * blocks, " block means");
  }
}

inline void check_block_total(int64_t block, int64_t total) {
  TORCH_CHECK_VALUE(block >= 1, "block must be >= 1, got ", block);
  TORCH_CHECK_VALUE(total >= 0, "total must be >= 0, got ", total);
}

}  // namespace division_checks
}  // namespace actnn_zoo
