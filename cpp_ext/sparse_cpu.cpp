// Sparse codes on the CPU: the compiled twin of reference.quantize_sparse / dequantize_sparse.
//
// A tensor with many exact zeros (a ReLU output) is kept as a 1-bit mask of its nonzeros plus
// the codes of the nonzeros only: at 2 bits and half the values zero that is 1 + 0.5 * 2 bits
// per value, the size of plain 2-bit codes, while the mask is exactly ReLU's backward mask and
// each group's range spans only its nonzero values (finer steps than a plain group, whose range
// starts at 0). Rows are independent: work is split over rows (a row's codes are packed back to
// back, so two groups of one row may share a byte). Quantize takes one pass over a row, group
// by group (the mask, the group's count and range, then its codes), into a scratch buffer; the
// rows are copied out once the row offsets (a prefix sum over rows) are known.
#include "kernels.h"
#include "half_cpu.h"
#include "codes_cpu.h"
#include "isa_cpu.h"
#include "pages_cpu.h"
#include "tasks_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace actnn_zoo {
namespace {

constexpr int kBlock = 256;  // values compacted and coded at a time

template <typename T>
AZ_INLINE float as_float(T v) {
  return static_cast<float>(v);  // exact for bfloat16
}
template <>
AZ_INLINE float as_float(c10::Half v) {
  return half_value(v.x);  // exact; vectorises (half_cpu.h)
}

template <typename T>
AZ_INLINE T from_float(float v) {
  return static_cast<T>(v);  // c10::BFloat16 rounds to nearest even, like .to()
}
template <>
AZ_INLINE c10::Half from_float(float v) {
  return c10::Half(half_from_float(v), c10::Half::from_bits());  // the same rounding, vectorised
}

// Rows per parallel task: about 32K values.
inline int64_t row_grain(int64_t d) { return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(d, 1)); }

// n <= kBlock values as float32 into buf, zero-padded up to n16 (a multiple of 16): zeros are
// outside every range and their codes are dropped.
template <typename T>
AZ_INLINE void load_padded(const T* x, int n, int n16, float* __restrict buf) {
#pragma omp simd
  for (int k = 0; k < n; ++k) buf[k] = as_float(x[k]);
  for (int k = n; k < n16; ++k) buf[k] = 0.0f;
}

// Bit i of the flat mask: x[i] != 0 (NaN -> 1, +-0.0 -> 0), 64 values at a time into bytes of
// 0/1, then 8 bytes into one (gather8, pack_compare's scheme). Tasks own whole bytes.

template <typename T>
void sparse_mask(const T* x, int64_t total, uint8_t* mask) {
  const int64_t blocks = total / 64;
  at::parallel_for(0, blocks, int64_t{1} << 10, [&](int64_t begin, int64_t end) {
    run_fast([&] {
      alignas(64) uint8_t m[64];
      for (int64_t blk = begin; blk < end; ++blk) {
        const T* v = x + blk * 64;
#pragma omp simd
        for (int k = 0; k < 64; ++k) m[k] = static_cast<uint8_t>(as_float(v[k]) != 0.0f);
        for (int j = 0; j < 8; ++j) mask[blk * 8 + j] = gather8(m + 8 * j);
      }
    });
  });
  for (int64_t i = blocks * 64; i < total; i += 8) {
    uint32_t byte = 0;
    for (int64_t k = i; k < std::min<int64_t>(total, i + 8); ++k)
      byte |= static_cast<uint32_t>(as_float(x[k]) != 0.0f) << (k - i);
    mask[i / 8] = static_cast<uint8_t>(byte);
  }
}

// One block's range over its nonzero values and their count (buf zero-padded to n16).
AZ_INLINE void block_range(const float* __restrict v, int n16, float& mn, float& mx, float& bad,
                           int32_t& cnt) {
  float lmn = mn, lmx = mx, lbad = bad;
  int32_t c = cnt;
#pragma omp simd reduction(min : lmn) reduction(max : lmx) reduction(+ : lbad, c)
  for (int k = 0; k < n16; ++k) {
    const bool on = v[k] != 0.0f;
    const float a = on ? v[k] : INFINITY;
    const float b = on ? v[k] : -INFINITY;
    lmn = a < lmn ? a : lmn;
    lmx = b > lmx ? b : lmx;
    lbad = lbad + v[k] * 0.0f;  // zeros add 0; Inf / NaN make it NaN
    c += on ? 1 : 0;
  }
  mn = lmn;
  mx = lmx;
  bad = lbad;
  cnt = c;
}

// For each mask byte: the rank of each bit (set bits below it), the number of set bits and the
// position of each set bit in order (select; 0 past the count). rank and select are the
// shuffle controls that move codes between the positions and the packed order of the nonzeros.
struct RankTable {
  alignas(8) uint8_t r[256][8];
  alignas(8) uint8_t select[256][8];
  uint8_t count[256];
  RankTable() {
    for (int b = 0; b < 256; ++b) {
      int c = 0;
      for (int j = 0; j < 8; ++j) {
        r[b][j] = static_cast<uint8_t>(c);
        select[b][j] = 0;
        if ((b >> j) & 1) select[b][c] = static_cast<uint8_t>(j);
        c += (b >> j) & 1;
      }
      count[b] = static_cast<uint8_t>(c);
    }
  }
};
const RankTable kRank;

// 16 bytes shuffled by a 16-byte control (out[i] = in[ctrl[i] & 15]): GCC's generic vector
// shuffle, one pshufb where it is compiled for SSSE3 and up (run_fast's AVX2 copy), element by
// element on the portable path -- the same bytes either way.
typedef uint8_t Bytes16 __attribute__((vector_size(16)));
typedef uint64_t Words2 __attribute__((vector_size(16)));

AZ_INLINE Bytes16 load16(const uint8_t* p) {
  Bytes16 v;
  std::memcpy(&v, p, 16);
  return v;
}

AZ_INLINE Bytes16 control16(const uint8_t* lo8, const uint8_t* hi8, uint64_t hi_add) {
  uint64_t a, b;
  std::memcpy(&a, lo8, 8);
  std::memcpy(&b, hi8, 8);
  b += hi_add * 0x0101010101010101ull;  // no carries: every byte stays below 16
  // Built in registers: two 8-byte stores read back as one 16-byte load would stall on store
  // forwarding (most of the kernel's time when measured).
  const Words2 v = {a, b};
  return reinterpret_cast<Bytes16>(v);
}

template <int B>
void pack_row(uint8_t* codes, int64_t count, uint8_t* out) {
  const int64_t nbytes = (count * B + 7) / 8;
  std::memset(codes + count, 0, 8);  // a last, partly filled byte gets zero codes
  for (int64_t j = 0; j < nbytes; j += 4096) {
    const int len = static_cast<int>(std::min<int64_t>(4096, nbytes - j));
    pack_block<B>(codes + j * (8 / B), len, out + j);
  }
}

// One pass over each row, group by group while the group is in cache: its range over the
// nonzeros and their count (and the mask bytes when rows are whole bytes: mask != nullptr, else
// sparse_mask wrote it), its metadata, then the codes of every position (quantize's codes), the
// nonzeros' kept in order and packed into `scratch` at the row's bound (room for every position's
// code). The rows are then copied to `data_out` back to back (offsets: a prefix sum of the packed
// sizes), a copy of the compressed size only.
template <typename T, bool kStochastic>
void quantize_sparse_impl(const T* x, int64_t n_rows, int64_t d, int64_t group_size,
                          const uint8_t* bits, uint32_t key, uint16_t* lo, uint16_t* step,
                          int64_t* counts, at::Tensor& data_out, int64_t* offsets,
                          uint8_t* mask) {
  const int64_t g_per_row = (d + group_size - 1) / group_size;
  std::vector<int64_t> bound(static_cast<size_t>(n_rows) + 1, 0);
  for (int64_t n = 0; n < n_rows; ++n) bound[n + 1] = bound[n] + (d * bits[n] + 7) / 8;
  std::vector<uint8_t> scratch(static_cast<size_t>(bound[n_rows]));
  parallel_tasks(n_rows, row_grain(d), [&](int64_t begin, int64_t end) {
    alignas(64) float buf[kBlock];
    alignas(64) int32_t codes[kBlock];
    alignas(64) uint8_t nz[kBlock];
    alignas(64) uint8_t code8[kBlock + 16];  // + 16: a shuffle reads 16 bytes from k
    std::vector<uint8_t> row(static_cast<size_t>(d) + 16);
    for (int64_t n = begin; n < end; ++n) {
      const int b = bits[n];
      const float levels = static_cast<float>((1 << b) - 1);
      uint8_t* r = row.data();
      int64_t c = 0;  // nonzeros so far in the row: the next code's index
      for (int64_t g = 0; g < g_per_row; ++g) {
        const int64_t start = g * group_size;
        const int64_t len = std::min(group_size, d - start);
        float mn = INFINITY, mx = -INFINITY, bad = 0.0f;
        int32_t cnt = 0;
        for (int64_t e = 0; e < len; e += kBlock) {
          const int blk = static_cast<int>(std::min<int64_t>(kBlock, len - e));
          const int n16 = (blk + 15) & ~15;
          load_padded(x + n * d + start + e, blk, n16, buf);
          block_range(buf, n16, mn, mx, bad, cnt);
          if (mask != nullptr) {  // rows of whole bytes: this block's mask bytes are its own
#pragma omp simd
            for (int k = 0; k < n16; ++k) nz[k] = static_cast<uint8_t>(buf[k] != 0.0f);
            uint8_t* mb = mask + ((n * d + start + e) >> 3);
            for (int j = 0; j < blk / 8; ++j) mb[j] = gather8(nz + 8 * j);
          }
        }
        const int64_t id = n * g_per_row + g;
        if (cnt == 0) {  // no nonzero: no codes
          lo[id] = 0;
          step[id] = 0;
          continue;
        }
        const GroupMeta m = group_meta(mn, mx, bad == 0.0f, levels);
        lo[id] = m.lo;
        step[id] = m.step;
        const float glo = bf16_value(m.lo);
        const float gstep = bf16_value(m.step);
        const float inv = gstep > 0.0f ? 1.0f / gstep : 0.0f;
        for (int64_t e = 0; e < len; e += kBlock) {
          const int blk = static_cast<int>(std::min<int64_t>(kBlock, len - e));
          const int n16 = (blk + 15) & ~15;
          if (len > kBlock) load_padded(x + n * d + start + e, blk, n16, buf);  // else loaded
          if (m.bad) {  // NaN metadata: codes 0
            std::fill(codes, codes + n16, 0);
          } else {
            code_block<kStochastic>(buf, n16, glo, inv, levels,
                                    static_cast<uint64_t>(n * d + start + e), key, codes);
          }
          // Keep the nonzeros' codes in order, 8 positions at a time: one byte shuffle by
          // the mask byte's select control moves its nonzeros' codes to the front, stored
          // at c (the bytes after them are overwritten by the next store, or lie past the
          // row's count, where pack_row ignores them).
#pragma omp simd
          for (int k = 0; k < n16; ++k) {
            nz[k] = static_cast<uint8_t>(buf[k] != 0.0f);
            code8[k] = static_cast<uint8_t>(codes[k]);
          }
          for (int k = 0; k < blk; k += 8) {
            const uint32_t mb = gather8(nz + k);  // zero past blk: buf is zero-padded
            const Bytes16 moved = __builtin_shuffle(
                load16(code8 + k), control16(kRank.select[mb], kRank.select[mb], 0));
            std::memcpy(r + c, &moved, 8);
            c += kRank.count[mb];
          }
        }
      }
      counts[n] = c;
      uint8_t* out = scratch.data() + bound[n];
      switch (b) {
        case 1: pack_row<1>(r, c, out); break;
        case 2: pack_row<2>(r, c, out); break;
        case 4: pack_row<4>(r, c, out); break;
        default: pack_row<8>(r, c, out); break;
      }
    }
  });
  offsets[0] = 0;
  for (int64_t n = 0; n < n_rows; ++n) offsets[n + 1] = offsets[n] + (counts[n] * bits[n] + 7) / 8;
  data_out = at::empty({offsets[n_rows]}, at::TensorOptions().dtype(at::kByte));
  uint8_t* data = data_out.data_ptr<uint8_t>();
  at::parallel_for(0, n_rows, row_grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      std::memcpy(data + offsets[n], scratch.data() + bound[n],
                  static_cast<size_t>(offsets[n + 1] - offsets[n]));
    }
  });
}

template <int B>
void unpack_row(const uint8_t* in, int64_t count, uint8_t* codes) {
  const int64_t nbytes = (count * B + 7) / 8;
  constexpr int kPer = 8 / B;
  constexpr uint32_t kMask = (1u << B) - 1u;
#pragma omp simd
  for (int64_t j = 0; j < nbytes; ++j) {
    const uint32_t v = in[j];
    for (int k = 0; k < kPer; ++k) codes[j * kPer + k] = static_cast<uint8_t>((v >> (B * k)) & kMask);
  }
}


// Up to 64 mask bits from bit i (the mask has `nbytes` bytes; bits past its end read as 0).
// Inside the mask (every word but the last few) two fixed-size loads from the mask itself: the
// zero-padded copy the tail needs is a variable-length memcpy into a stack buffer read back at
// once, a library call and a failed store forward per 64 values when it was taken every time.
AZ_INLINE uint64_t mask_word(const uint8_t* mask, int64_t nbytes, int64_t i) {
  const int64_t b0 = i >> 3;
  const int shift = static_cast<int>(i & 7);
  uint64_t lo;
  uint64_t hi;
  if (b0 + 9 <= nbytes) {
    std::memcpy(&lo, mask + b0, 8);
    hi = mask[b0 + 8];
  } else {
    uint8_t tmp[16] = {0};
    std::memcpy(tmp, mask + b0, static_cast<size_t>(nbytes - b0));
    std::memcpy(&lo, tmp, 8);
    hi = tmp[8];
  }
  return shift ? (lo >> shift) | (hi << (64 - shift)) : lo;
}

template <typename TO>
void dequantize_sparse_impl(const uint8_t* data, const uint16_t* lo, const uint16_t* step,
                            const uint8_t* mask, const uint8_t* bits, const int64_t* offsets,
                            const int64_t* counts, int64_t n_rows, int64_t d, int64_t group_size,
                            TO* out) {
  const int64_t g_per_row = (d + group_size - 1) / group_size;
  const int64_t mask_bytes = (n_rows * d + 7) / 8;
  parallel_tasks(n_rows, row_grain(d), [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> row(static_cast<size_t>(d) + 16);
    alignas(64) uint8_t q[64];
    alignas(64) float v[64];
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* r = row.data();
      switch (bits[n]) {
        case 1: unpack_row<1>(data + offsets[n], counts[n], row.data()); break;
        case 2: unpack_row<2>(data + offsets[n], counts[n], row.data()); break;
        case 4: unpack_row<4>(data + offsets[n], counts[n], row.data()); break;
        default: unpack_row<8>(data + offsets[n], counts[n], row.data()); break;
      }
      int64_t c = 0;
      for (int64_t g = 0; g < g_per_row; ++g) {
        const int64_t id = n * g_per_row + g;
        const float glo = bf16_value(lo[id]);
        const float gstep = bf16_value(step[id]);
        const int64_t start = g * group_size;
        const int64_t len = std::min(group_size, d - start);
        for (int64_t e = 0; e < len; e += 64) {
          const int blk = static_cast<int>(std::min<int64_t>(64, len - e));
          const int64_t i0 = n * d + start + e;
          uint64_t w = mask_word(mask, mask_bytes, i0);
          if (blk < 64) w &= (uint64_t{1} << blk) - 1u;  // the next group's bits
          // Two steps, so that the arithmetic runs on vectors: (1) 16 positions at a time,
          // one byte shuffle moves the codes of their nonzeros (in order from c) to the
          // positions, its control the ranks of the two mask bytes' bits (a clear bit picks a
          // code it then drops); (2) lo + code * step, branch-free: a clear bit selects +0.0
          // by masking the value's bits with 0 - bit (the bits are random, a branch would
          // mispredict half the time).
          for (int k = 0; k < blk; k += 16) {
            const uint32_t mb0 = static_cast<uint32_t>(w >> k) & 0xFFu;
            const uint32_t mb1 = static_cast<uint32_t>(w >> (k + 8)) & 0xFFu;
            const uint32_t c0 = kRank.count[mb0];
            const Bytes16 codes =
                __builtin_shuffle(load16(r + c), control16(kRank.r[mb0], kRank.r[mb1], c0));
            std::memcpy(q + k, &codes, 16);
            c += c0 + kRank.count[mb1];
          }
          const uint32_t w_lo = static_cast<uint32_t>(w), w_hi = static_cast<uint32_t>(w >> 32);
          TO* o = out + i0;
          if constexpr (std::is_same<TO, float>::value) {
#pragma omp simd
            for (int t = 0; t < blk; ++t) {
              const uint32_t on = 0u - (((t < 32 ? w_lo : w_hi) >> (t & 31)) & 1u);
              const float s = static_cast<float>(q[t]) * gstep;
              o[t] = bits_float(float_bits(s + glo) & on);
            }
          } else {
#pragma omp simd
            for (int t = 0; t < blk; ++t) {
              const uint32_t on = 0u - (((t < 32 ? w_lo : w_hi) >> (t & 31)) & 1u);
              const float s = static_cast<float>(q[t]) * gstep;
              v[t] = bits_float(float_bits(s + glo) & on);
            }
            for (int t = 0; t < blk; ++t) o[t] = from_float<TO>(v[t]);
          }
        }
      }
    }
  });
}

// Set bits of the flat mask in [begin, end).
int64_t count_bits(const uint8_t* m, int64_t begin, int64_t end) {
  int64_t cnt = 0;
  int64_t i = begin;
  for (; i < end && (i & 7); ++i) cnt += (m[i >> 3] >> (i & 7)) & 1;
  // a table, not __builtin_popcount: without -mpopcnt that is a libgcc call per byte (a tenth
  // of dequantize_sparse's time on a CNN map)
  for (; i + 8 <= end; i += 8) cnt += kRank.count[m[i >> 3]];
  for (; i < end; ++i) cnt += (m[i >> 3] >> (i & 7)) & 1;
  return cnt;
}

void check_rows_widths(const at::Tensor& bits, int64_t n_rows) {
  TORCH_CHECK(bits.device().is_cpu(), "bits must be a CPU tensor");
  TORCH_CHECK(bits.scalar_type() == at::kByte && bits.dim() == 1 && bits.size(0) == n_rows &&
                  bits.is_contiguous(),
              "bits must be a contiguous uint8 tensor of shape (", n_rows, ",)");
  const uint8_t* b = bits.data_ptr<uint8_t>();
  for (int64_t n = 0; n < n_rows; ++n) {
    TORCH_CHECK_VALUE(b[n] == 1 || b[n] == 2 || b[n] == 4 || b[n] == 8, "bits[", n,
                      "] must be 1, 2, 4 or 8, got ", static_cast<int>(b[n]));
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_sparse(
    const at::Tensor& x2d, const at::Tensor& bits, int64_t group_size, int64_t seed,
    bool stochastic, const std::optional<at::Tensor>& mask_out) {
  RECORD_USER_SCOPE("actnn_zoo::quantize_sparse");
  TORCH_CHECK(x2d.device().is_cpu(), "quantize_sparse: no kernel for tensors on ", x2d.device(),
              " (CPU only)");
  TORCH_CHECK(x2d.dim() == 2 && x2d.is_contiguous(), "x2d must be a contiguous 2-d tensor");
  const at::ScalarType t = x2d.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16,
              "x2d must be float32, float16 or bfloat16, got ", t);
  TORCH_CHECK_VALUE(group_size > 0 && group_size % 8 == 0,
                    "group_size must be a positive multiple of 8, got ", group_size);
  const int64_t n_rows = x2d.size(0), d = x2d.size(1);
  check_rows_widths(bits, n_rows);
  const int64_t g = (d + group_size - 1) / group_size;
  auto opts = x2d.options();
  at::Tensor lo = at::empty({n_rows, g}, opts.dtype(at::kBFloat16));
  at::Tensor step = at::empty({n_rows, g}, opts.dtype(at::kBFloat16));
  // the mask into the caller's buffer when given (a ReLU node's, which reads it in backward:
  // written through its pointer, so the buffer's version counter does not move)
  at::Tensor mask;
  if (mask_out.has_value()) {
    check_byte_buffer(*mask_out, (n_rows * d + 7) / 8, "quantize_sparse: mask_out");
    mask = *mask_out;
  } else {
    mask = at::empty({(n_rows * d + 7) / 8}, opts.dtype(at::kByte));
  }
  at::Tensor offsets = at::empty({n_rows + 1}, opts.dtype(at::kLong));
  std::vector<int64_t> counts(static_cast<size_t>(n_rows));
  at::Tensor data;
  const uint32_t key = seed_key(static_cast<uint32_t>(seed));
  uint16_t* lo_p = reinterpret_cast<uint16_t*>(lo.data_ptr());
  uint16_t* step_p = reinterpret_cast<uint16_t*>(step.data_ptr());
  const uint8_t* b = bits.data_ptr<uint8_t>();
  int64_t* off = offsets.data_ptr<int64_t>();
  auto run = [&](auto* x) {
    uint8_t* fused = nullptr;  // the mask written by pass 1 (rows of whole bytes)
    if (d % 8 == 0) {
      fused = mask.data_ptr<uint8_t>();
    } else {
      sparse_mask(x, n_rows * d, mask.data_ptr<uint8_t>());
    }
    if (stochastic) {
      quantize_sparse_impl<std::remove_const_t<std::remove_pointer_t<decltype(x)>>, true>(
          x, n_rows, d, group_size, b, key, lo_p, step_p, counts.data(), data, off, fused);
    } else {
      quantize_sparse_impl<std::remove_const_t<std::remove_pointer_t<decltype(x)>>, false>(
          x, n_rows, d, group_size, b, key, lo_p, step_p, counts.data(), data, off, fused);
    }
  };
  if (t == at::kFloat) {
    run(x2d.data_ptr<float>());
  } else if (t == at::kHalf) {
    run(x2d.data_ptr<c10::Half>());
  } else {
    run(x2d.data_ptr<c10::BFloat16>());
  }
  return {data, lo, step, mask, offsets};
}

}  // namespace

// Declared in kernels.h: qlayers.cpp's nodes decode with it too.
at::Tensor dequantize_sparse_cpu(const at::Tensor& data, const at::Tensor& lo,
                                 const at::Tensor& step, const at::Tensor& mask,
                                 const at::Tensor& bits, const at::Tensor& offsets,
                                 int64_t group_size, at::Tensor out) {
  RECORD_USER_SCOPE("actnn_zoo::dequantize_sparse");
  TORCH_CHECK(out.device().is_cpu(), "dequantize_sparse: no kernel for tensors on ", out.device(),
              " (CPU only)");
  for (const at::Tensor* t : {&data, &lo, &step, &mask, &bits, &offsets}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(),
                "dequantize_sparse: every tensor must be contiguous on the CPU");
  }
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous(), "out must be a contiguous 2-d tensor");
  const at::ScalarType t = out.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16,
              "out must be float32, float16 or bfloat16, got ", t);
  TORCH_CHECK_VALUE(group_size > 0 && group_size % 8 == 0,
                    "group_size must be a positive multiple of 8, got ", group_size);
  const int64_t n_rows = out.size(0), d = out.size(1);
  const int64_t g = (d + group_size - 1) / group_size;
  check_rows_widths(bits, n_rows);
  TORCH_CHECK(data.scalar_type() == at::kByte && mask.scalar_type() == at::kByte,
              "data and mask must be uint8");
  TORCH_CHECK(lo.scalar_type() == at::kBFloat16 && step.scalar_type() == at::kBFloat16 &&
                  lo.numel() == n_rows * g && step.numel() == n_rows * g,
              "lo and step must be bfloat16 of shape (", n_rows, ", ", g, ")");
  TORCH_CHECK(mask.numel() == (n_rows * d + 7) / 8, "mask must hold ", n_rows * d, " bits");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.numel() == n_rows + 1,
              "offsets must be int64 of shape (", n_rows + 1, ",)");
  // Every row's codes inside data: count its nonzeros from the mask.
  const uint8_t* m = mask.data_ptr<uint8_t>();
  const uint8_t* b = bits.data_ptr<uint8_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  std::vector<int64_t> counts(static_cast<size_t>(n_rows));
  at::parallel_for(0, n_rows, row_grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) counts[n] = count_bits(m, n * d, (n + 1) * d);
  });
  for (int64_t n = 0; n < n_rows; ++n) {
    const int64_t need = (counts[n] * b[n] + 7) / 8;
    TORCH_CHECK_VALUE(off[n] >= 0 && off[n] <= data.numel() - need, "row ", n, " (", need,
                      " bytes at offset ", off[n], ") does not fit in data (", data.numel(),
                      " bytes)");
  }
  advise_huge_pages(out.data_ptr(), out.numel() * static_cast<int64_t>(out.element_size()));
  const uint8_t* dp = data.data_ptr<uint8_t>();
  const uint16_t* lp = reinterpret_cast<const uint16_t*>(lo.data_ptr());
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(step.data_ptr());
  if (t == at::kFloat) {
    dequantize_sparse_impl(dp, lp, sp, m, b, off, counts.data(), n_rows, d, group_size, out.data_ptr<float>());
  } else if (t == at::kHalf) {
    dequantize_sparse_impl(dp, lp, sp, m, b, off, counts.data(), n_rows, d, group_size,
                           out.data_ptr<c10::Half>());
  } else {
    dequantize_sparse_impl(dp, lp, sp, m, b, off, counts.data(), n_rows, d, group_size,
                           out.data_ptr<c10::BFloat16>());
  }
  return out;
}

void register_sparse(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("quantize_sparse", &quantize_sparse, py::call_guard<py::gil_scoped_release>(),
        py::arg("x2d"), py::arg("bits"), py::arg("group_size"), py::arg("seed"),
        py::arg("stochastic"), py::arg("mask_out") = py::none(),
        "(N, D) float -> (data, lo, step, mask, offsets): codes of the nonzeros only "
        "(reference.quantize_sparse). CPU only. mask_out: the buffer the mask is written into "
        "(and returned as mask), else a new one.");
  m.def("dequantize_sparse", &dequantize_sparse_cpu, py::call_guard<py::gil_scoped_release>(),
        py::arg("data"), py::arg("lo"), py::arg("step"), py::arg("mask"), py::arg("bits"),
        py::arg("offsets"), py::arg("group_size"), py::arg("out"),
        "Inverse of quantize_sparse into out (N, D) (reference.dequantize_sparse). CPU only.");
}

}  // namespace actnn_zoo
