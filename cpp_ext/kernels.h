// The kernel interface of actnn_zoo._C. Each function is the compiled twin of the function of
// the same name in actnn_zoo/quant/reference.py and must give bit-identical results.
#pragma once
#include <torch/extension.h>
#include "bf16.h"  // AZ_HD (host + device inline)
#include "variance.h"  // VarPayload, VarSource, VarCorrection, Strided
#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>

namespace actnn_zoo {

// The counter-based random number of the contract: u in [0, 1) from (seed key, element index).
//   key = fmix32(seed + 0x9E3779B9)                       (once per call)
//   h   = fmix32(lo32(i) ^ key ^ (hi32(i) * 0x85EBCA6B))
//   u   = (h >> 8) * 2^-24
AZ_HD uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}
AZ_HD uint32_t seed_key(uint32_t seed) { return fmix32(seed + 0x9E3779B9u); }
AZ_HD float uniform_from_index(uint64_t i, uint32_t key) {
  uint32_t h = fmix32(static_cast<uint32_t>(i) ^ key ^ (static_cast<uint32_t>(i >> 32) * 0x85EBCA6Bu));
  return static_cast<float>(h >> 8) * (1.0f / 16777216.0f);
}

// The attention dropout's keep-mask (functional/attention.py, _Dropout): element (n, r, j) of
// an (N, L, S) call is kept when fmix32(row_hash(n * L + r) ^ col_hash(j)) < threshold
// (unsigned), with the row's hash mixing both 32-bit halves of the int64 row index. One copy
// for the CPU loop (attention_dropout_cpu.cpp) and the CUDA kernel (attention_dropout_cuda.cu).
AZ_HD uint32_t keep_row_hash(int64_t row, uint32_t s2) {
  return fmix32(fmix32(static_cast<uint32_t>(row) ^ s2) ^
                static_cast<uint32_t>(static_cast<uint64_t>(row) >> 32));
}
AZ_HD uint32_t keep_col_hash(int64_t j, uint32_t s1) { return fmix32(static_cast<uint32_t>(j) ^ s1); }
AZ_HD bool keep_of(uint32_t row_hash, uint32_t col_hash, uint32_t threshold) {
  return fmix32(row_hash ^ col_hash) < threshold;
}

// Bytes of one row of d codes at width w (reference.row_offsets' step), CPU and CUDA.
AZ_HD int64_t row_bytes(uint32_t w, int64_t d) { return (static_cast<int64_t>(w) * d + 7) / 8; }

// (N, D) of the quantization contract's row view of a tensor of `shape`: dim 0 is the sample,
// the rest one row; a 0-d or 1-d tensor is one row (reference.contract_rows' twin).
inline std::pair<int64_t, int64_t> contract_rows(at::IntArrayRef shape) {
  if (shape.size() <= 1) return {1, shape.empty() ? 1 : shape[0]};
  int64_t d = 1;
  for (size_t i = 1; i < shape.size(); ++i) d *= shape[i];
  return {shape[0], d};
}

// Raise ValueError unless `t` is a contiguous uint8 CPU tensor of `bytes` bytes: a buffer a
// kernel writes through its pointer for its caller (a ReLU node's mask, its 1-byte flag).
inline void check_byte_buffer(const at::Tensor& t, int64_t bytes, const char* what) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kByte && t.is_contiguous() &&
                        t.numel() == bytes,
                    what, " must be a contiguous uint8 CPU tensor of ", bytes, " bytes, got ",
                    t.numel(), " of ", t.scalar_type(), " on ", t.device());
}

// x2d: (N, D) contiguous float32/float16/bfloat16. bits: (N,) uint8 in {1,2,4,8}.
// offsets: (N + 1,) int64 byte offset of each row, offsets[N] <= total (bytes after the last
// row, a capacity the caller sized without reading the widths back, are zeroed).
// A positive step below 2^-126 (denormal) is raised to 2^-126 after the two corrections, so that
// 1 / step stays finite (see reference.group_metadata).
// Returns (data uint8 [total], lo bf16 (N, G), step bf16 (N, G)), G = ceil(D / group_size).
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cpu(
    const at::Tensor& x2d, const at::Tensor& bits, const at::Tensor& offsets, int64_t total,
    int64_t group_size, int64_t seed, bool stochastic);
// quantize_cpu of (x - shift[i]) * scale[i] (float32, two roundings), i = n * row_stride +
// p / block at position p of row n, without making that tensor: a norm's normalized input.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_affine_cpu(
    const at::Tensor& x2d, const at::Tensor& shift, const at::Tensor& scale, int64_t row_stride,
    int64_t block, const at::Tensor& bits, const at::Tensor& offsets, int64_t total,
    int64_t group_size, int64_t seed, bool stochastic);
// Writes q * step + lo (float32 arithmetic) into out (N, D), contiguous, any float dtype.
at::Tensor dequantize_cpu(const at::Tensor& data, const at::Tensor& lo, const at::Tensor& step,
                          const at::Tensor& bits, const at::Tensor& offsets, int64_t group_size,
                          at::Tensor& out);
// The three above with one width for every row, rows back to back (quantize_uniform's layout;
// dequantize reads rows first .. first + N of lo, step and the codes): no widths or offsets
// tensors are made, the layout is arithmetic. quantize_uniform_cpu's x and
// dequantize_uniform_cpu's out may have any shape (contiguous): their rows are the
// contract's, dim 0 the sample and a 0-d or 1-d tensor one row, read without a view.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_uniform_cpu(
    const at::Tensor& x, int64_t bits, int64_t group_size, int64_t seed, bool stochastic);
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_affine_uniform_cpu(
    const at::Tensor& x2d, const at::Tensor& shift, const at::Tensor& scale, int64_t row_stride,
    int64_t block, int64_t bits, int64_t group_size, int64_t seed, bool stochastic);
at::Tensor dequantize_uniform_cpu(const at::Tensor& data, const at::Tensor& lo,
                                  const at::Tensor& step, int64_t bits, int64_t group_size,
                                  int64_t first, at::Tensor& out);
// Flat bool -> ceil(n / 8) bytes, element i at bit i % 8 of byte i / 8; and back.
at::Tensor pack_mask_cpu(const at::Tensor& mask);
at::Tensor unpack_mask_cpu(const at::Tensor& packed, int64_t numel);
// sparse_cpu.cpp: decode sparse codes (quantize_sparse's) into a contiguous (N, D) out
at::Tensor dequantize_sparse_cpu(const at::Tensor& data, const at::Tensor& lo,
                                 const at::Tensor& step, const at::Tensor& mask,
                                 const at::Tensor& bits, const at::Tensor& offsets,
                                 int64_t group_size, at::Tensor out);
// Auto precision on the CPU (widths_cpu.cpp; the GPU runs the torch versions in
// actnn_zoo/precision): (N,) float32 per-sample sum over groups of len * range^2 of a contiguous
// (N, D) float tensor; and uint8 widths in {1, 2, 4, 8} for float32 scores under `extra` bits
// above 1 each (bit-identical to actnn_zoo.precision.solver.allocate_samples).
// Fused backward of the 1-bit-mask layers (ReLU family, Dropout): grad contiguous float32/
// float64/float16/bfloat16 of n values, packed ceil(n / 8) bytes as pack_mask writes them.
// Element i: bit set -> grad (on empty) or grad * on; clear -> +0.0 (off empty) or grad * off,
// products in float32 for the 16-bit types (float64 for float64), rounded to nearest even:
// bit-identical to torch.where(mask, grad, 0 / grad * off) and grad * noise. Contiguous result.
at::Tensor masked_grad_cpu(const at::Tensor& grad, const at::Tensor& packed,
                           std::optional<double> on, std::optional<double> off);
at::Tensor range_statistic_cpu(const at::Tensor& x2d, int64_t group_size);
// range_statistic_cpu of contiguous x read as (n_rows, d) rows, into out[n_rows]: no row view
// and no output tensor made (choose_widths, once per watched layer per step)
void range_statistic_rows_cpu(const at::Tensor& x, int64_t n_rows, int64_t d,
                              int64_t group_size, float* out);
at::Tensor allocate_widths_cpu(const at::Tensor& score, double extra);
// The sampled rounding variances of softmax's and the norms' unbiased backward
// (variance_cpu.cpp; torch twin in actnn_zoo/functional/_rounding_variance.py): the 1-bit codes
// of the variances at flat indices offset + k * stride, one uint8 buffer [lo (G bf16) | step
// (G bf16) | bits], and the in-place correction of an input gradient from them; (offset, seed)
// from torch's CPU generator.
std::tuple<int64_t, int64_t> draw_sample_cpu(int64_t stride);
at::Tensor rounding_variance_codes_cpu(
    const at::Tensor& lo, const at::Tensor& step, const std::optional<at::Tensor>& row_bits,
    int64_t bits, int64_t group_size, const at::Tensor& src,
    const std::optional<at::Tensor>& shift, const std::optional<at::Tensor>& scale,
    int64_t stat_block, int64_t stat_period, int64_t offset, int64_t stride, int64_t seed);
at::Tensor rounding_variance_correct_cpu(
    at::Tensor grad_in, const at::Tensor& grad, const at::Tensor& codes, int64_t offset,
    int64_t stride, const std::optional<at::Tensor>& scale,
    int64_t stat_block, int64_t stat_period, const std::optional<at::Tensor>& weight,
    int64_t weight_block, int64_t weight_period, double divisor);

// attention_dropout_cpu.cpp: the attention Function's forward and backward when one tile
// holds the call (float32 (N, L, E), (N, S, E), (N, S, Ev); dropout when threshold >= 0).
at::Tensor attention_whole_forward_cpu(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, double scale, bool causal,
                                       int64_t threshold, int64_t s1, int64_t s2,
                                       double drop_scale);
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_whole_backward_cpu(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k,
    const std::optional<at::Tensor>& v, double scale, bool causal, int64_t threshold,
    int64_t s1, int64_t s2, double drop_scale, bool need_q, bool need_k, bool need_v);

// norm_cpu.cpp: the norms' backward from the codes of x_hat at one width plus the
// rounding-variance correction (grad_input or undefined, grad_weight, grad_bias).
std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_backward_fused_cpu(
    const at::Tensor& grad, const at::Tensor& data, const at::Tensor& lo, const at::Tensor& step,
    int64_t bits, int64_t group_size, const at::Tensor& invstd,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& var,
    int64_t var_offset, int64_t var_stride, bool need_input);
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_fused_cpu(
    const at::Tensor& grad, const at::Tensor& data, const at::Tensor& lo, const at::Tensor& step,
    int64_t bits, int64_t group_size, const at::Tensor& rstd,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& var,
    int64_t var_offset, int64_t var_stride, int64_t normalized_numel, bool need_input);
std::tuple<at::Tensor, at::Tensor, at::Tensor> group_norm_backward_fused_cpu(
    const at::Tensor& grad, const at::Tensor& data, const at::Tensor& lo, const at::Tensor& step,
    int64_t bits, int64_t group_size, const at::Tensor& rstd,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& var,
    int64_t var_offset, int64_t var_stride, int64_t groups, bool need_input);

#ifdef ACTNN_ZOO_CUDA
// Raise when the current CUDA stream is being captured into a CUDA graph (torch.cuda.graph,
// torch.compile's mode="reduce-overhead"): a replay launches the kernel with the seed it was
// captured with, so every replay would round alike and the codes stop being unbiased across
// steps. Stochastic rounding only; ``fn`` names the caller in the message.
void check_not_capturing(const char* fn);
// lean: the lean kernel where it applies (quant_cuda.cu: one warp per group, vector loads),
// the same results with fewer instructions; not the default until a GPU run checks its parity.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cuda(
    const at::Tensor& x2d, const at::Tensor& bits, const at::Tensor& offsets, int64_t total,
    int64_t group_size, int64_t seed, bool stochastic, bool lean = false);
at::Tensor dequantize_cuda(const at::Tensor& data, const at::Tensor& lo, const at::Tensor& step,
                           const at::Tensor& bits, const at::Tensor& offsets, int64_t group_size,
                           at::Tensor& out);
at::Tensor pack_mask_cuda(const at::Tensor& mask);
at::Tensor unpack_mask_cuda(const at::Tensor& packed, int64_t numel);
at::Tensor masked_grad_cuda(const at::Tensor& grad, const at::Tensor& packed,
                            std::optional<double> on, std::optional<double> off);
// attention_dropout_cuda.cu: the keep-mask of one tile on `device` (attention_keep's CUDA
// half; arguments checked by attention_keep first).
at::Tensor attention_keep_cuda(int64_t n0, int64_t n1, int64_t r0, int64_t r1, int64_t cols,
                               int64_t L, int64_t s1, int64_t s2, int64_t threshold,
                               c10::Device device);
// widths_cuda.cu: allocate_widths_cpu's twin for a contiguous 1-d float32 score on CUDA (checked
// by the caller).
at::Tensor allocate_widths_cuda(const at::Tensor& score, double extra);
// (N + 1,) int64 byte offsets of rows of d codes at uint8 widths `bits` (N,) on CUDA: row_offsets'
// CUDA half (the caller checked bits).
at::Tensor row_offsets_cuda(int64_t d, const at::Tensor& bits);
// range_statistic_cpu's twin for a contiguous (N, D) float32/float16/bfloat16 x2d on CUDA
// (checked by the caller): the same values bit for bit (widths.h's range_term, summed in order).
at::Tensor range_statistic_cuda(const at::Tensor& x2d, int64_t group_size);
// variance_cuda.cu: rounding_variance_codes / _correct_ on CUDA, their arguments checked and
// laid out by variance_cpu.cpp (check_codes, check_correct) first.
at::Tensor rounding_variance_codes_cuda(const VarPayload& p, const VarSource& s,
                                        const at::Tensor& src, int64_t numel, int64_t offset,
                                        int64_t stride, int64_t slots, int64_t seed);
void rounding_variance_correct_cuda(at::Tensor& grad_in, const at::Tensor& grad,
                                    const VarCorrection& c, const Strided& gi_at,
                                    const Strided& g_at, int64_t offset, int64_t stride,
                                    int64_t kept);
#endif

}  // namespace actnn_zoo
