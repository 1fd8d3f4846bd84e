// CUDA twins of the kernels in actnn_zoo/quant/reference.py (interface: kernels.h).
//
// Every floating-point step is the same single fp32 rounding as in the reference, written with
// explicit round-to-nearest intrinsics (__fadd_rn, __fsub_rn, __fmul_rn, __fdiv_rn) so that no
// multiply-add is ever contracted, whatever --fmad says; fp32 <-> bf16 conversions are done on
// the bit patterns. Given the same inputs and seed, codes, lo/step and dequantized values equal
// the reference's bit for bit, with two documented exceptions that compare equal as numbers:
// a group holding both +0.0 and -0.0 (torch's amin/amax pick an order-dependent zero; here -0.0
// orders below +0.0), and NaN payloads (outputs here are always the positive quiet NaN: f32
// 0x7FC00000, f16 0x7E00, bf16 0x7FC0, as c10's scalar conversions write them).
//
// quantize: one "lane group" of LPG = min(32, next_pow2(group_size / 8)) lanes of a warp handles
//   one (row, group) pair; a warp handles 32 / LPG pairs side by side, and warps walk the
//   N * G pairs in a grid-stride loop (64-bit indices; the grid is capped at 32 blocks per SM).
//   Each lane owns "octets": 8 consecutive values that start on a multiple of 8 inside the row.
//   Because group_size is a multiple of 8 and a width b divides 8, an octet's codes fill exactly
//   b whole bytes of its row (fewer only for the last, short octet of a row), so every byte is
//   written by exactly one lane, once: no atomics, no shared memory. Range (min/max + non-finite
//   flag) is reduced with xor shuffles inside the lane group, then every lane of the group
//   derives lo/step redundantly, quantizes its octets (kept in registers when the group has at
//   most 4 * 32 octets, re-read otherwise) and stores their bytes. Bytes that belong to no row
//   (only with hand-made offsets) are zeroed, as the reference leaves them.
// dequantize: one thread per output octet, grid-stride (64-bit).
// pack_mask: one thread per output byte; unpack_mask: one thread per output element.
// Inputs/outputs: float32, float16, bfloat16 (the CPU twin accepts the same three).
//
// Messages print no tensor sizes (IntArrayRef): on an H200 (torch 2.11, CUDA 13) a failing check
// here whose message printed x2d.sizes() crashed the interpreter; bindings.cpp runs the same
// checks, with sizes, before calling in.
//
// Memory safety without device synchronisation: the values of bits and offsets stay on the GPU
// and are not validated on the host; instead every store is clipped to data[0, total) and every
// code load to data[0, data.numel()), and a width outside {1, 2, 4, 8} packs nothing.

#include "kernels.h"

#include <ATen/Dispatch.h>
// Only c10/cuda headers: ATen/cuda/CUDAContext.h pulls in cuBLAS/cuSPARSE/cuSOLVER headers, which
// a bare CUDA toolkit (nvcc only) lacks. c10::cuda::getCurrentCUDAStream is the function that
// at::cuda::getCurrentCUDAStream names (at::cuda does `using namespace c10::cuda`).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cstdint>

#if defined(__USE_FAST_MATH__)
#error "quant_cuda.cu must not be built with --use_fast_math: it breaks bit parity with the CPU kernels"
#endif

namespace actnn_zoo {
namespace {

constexpr int kThreads = 256;               // threads per block, all kernels
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int kMaxCachedOctets = 4;         // octets per lane held in registers
constexpr unsigned kFullMask = 0xffffffffu;
// ------------------------------------------------------------------------------------------------
// fp32 helpers (bf16 rounding and the group metadata are in bf16.h, shared with the CPU kernels)
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ bool is_finite_f32(float v) {
  return (__float_as_uint(v) & 0x7F800000u) != 0x7F800000u;
}
__device__ __forceinline__ bool is_nan_f32(float v) {
  return (__float_as_uint(v) & 0x7FFFFFFFu) > 0x7F800000u;
}

__device__ __forceinline__ bool valid_width(int b) { return b == 1 || b == 2 || b == 4 || b == 8; }

// ------------------------------------------------------------------------------------------------
// Loads: one value, or 8 consecutive values with vector loads (caller guarantees alignment)
// ------------------------------------------------------------------------------------------------
template <typename T>
struct Ld;

template <>
struct Ld<float> {
  static __device__ __forceinline__ float one(const float* p) { return __ldg(p); }
  static __device__ __forceinline__ void eight(const float* p, float v[8]) {  // 16-byte aligned
    const float4 a = __ldg(reinterpret_cast<const float4*>(p));
    const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  }
};

__device__ __forceinline__ float half_bits_to_f32(uint16_t h) { return __half2float(__ushort_as_half(h)); }

template <>
struct Ld<c10::Half> {
  static __device__ __forceinline__ float one(const c10::Half* p) {
    return half_bits_to_f32(__ldg(reinterpret_cast<const unsigned short*>(p)));
  }
  static __device__ __forceinline__ void eight(const c10::Half* p, float v[8]) {  // 16-byte aligned
    const uint4 r = __ldg(reinterpret_cast<const uint4*>(p));
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = half_bits_to_f32(static_cast<uint16_t>(w[i] & 0xFFFFu));
      v[2 * i + 1] = half_bits_to_f32(static_cast<uint16_t>(w[i] >> 16));
    }
  }
};

template <>
struct Ld<c10::BFloat16> {
  static __device__ __forceinline__ float one(const c10::BFloat16* p) {
    return bf16_value(__ldg(reinterpret_cast<const unsigned short*>(p)));
  }
  static __device__ __forceinline__ void eight(const c10::BFloat16* p, float v[8]) {
    const uint4 r = __ldg(reinterpret_cast<const uint4*>(p));
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = __uint_as_float(w[i] << 16);
      v[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
  }
};

// Values e .. e + c - 1 (c in [0, 8]) into v[0 .. c-1]; v[c .. 7] = 0.
template <typename T>
__device__ __forceinline__ void load_octet(const T* __restrict__ x, int64_t e, int c, bool vec,
                                           float v[8]) {
  if (vec && c == 8) {
    Ld<T>::eight(x + e, v);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = (j < c) ? Ld<T>::one(x + e + j) : 0.0f;
  }
}

// ------------------------------------------------------------------------------------------------
// Per-group metadata and codes (reference.group_metadata / quantize_codes, one group)
// ------------------------------------------------------------------------------------------------
struct Range {
  float mn, mx;
  bool nonfinite;
};

// min/max that order -0.0 below +0.0, so that they are commutative and the result does not depend
// on the reduction order: a group of -0.0 only gets lo = -0.0 exactly like torch's amin; for a
// group holding both zeros, torch's choice is order-dependent and lo/step compare equal anyway.
// NaN never enters (the non-finite flag covers it; a NaN operand a is never selected).
__device__ __forceinline__ float min_ordered(float a, float b) {
  return (a < b || (a == b && (__float_as_uint(a) & 0x80000000u) != 0)) ? a : b;
}
__device__ __forceinline__ float max_ordered(float a, float b) {
  return (a > b || (a == b && (__float_as_uint(a) & 0x80000000u) == 0)) ? a : b;
}

__device__ __forceinline__ void range_add(Range& r, const float v[8], int c) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (j < c) {
      r.nonfinite |= !is_finite_f32(v[j]);
      r.mn = min_ordered(v[j], r.mn);
      r.mx = max_ordered(v[j], r.mx);
    }
  }
}

// Reduce over the `lpg` lanes of an aligned lane group. Every lane of the warp must call this.
__device__ __forceinline__ void range_reduce(Range& r, int lpg) {
  for (int off = lpg >> 1; off > 0; off >>= 1) {
    r.mn = min_ordered(__shfl_xor_sync(kFullMask, r.mn, off), r.mn);
    r.mx = max_ordered(__shfl_xor_sync(kFullMask, r.mx, off), r.mx);
    r.nonfinite |= (__shfl_xor_sync(kFullMask, static_cast<int>(r.nonfinite), off) != 0);
  }
}

struct Meta {
  float lo, step, inv, lv;
  uint16_t lo_bits, step_bits;
};

// group_meta (bf16.h) with the float values the codes use.
__device__ __forceinline__ Meta group_meta_of(const Range& r, float lv) {
  const GroupMeta g = group_meta(r.mn, r.mx, !r.nonfinite, lv);
  Meta m;
  m.lv = lv;
  m.lo_bits = g.lo;
  m.step_bits = g.step;
  m.lo = bf16_value(g.lo);
  m.step = bf16_value(g.step);
  m.inv = (m.step > 0.0f) ? __fdiv_rn(1.0f, m.step) : 0.0f;  // NaN > 0 is false
  return m;
}

__device__ __forceinline__ uint32_t code_of(float x, const Meta& m, float u) {
  const float t = __fadd_rn(__fmul_rn(__fsub_rn(x, m.lo), m.inv), u);
  float q = floorf(t);
  if (is_nan_f32(q)) q = 0.0f;
  q = fmaxf(q, 0.0f);
  q = fminf(q, m.lv);
  return static_cast<uint32_t>(q);
}

// Codes of one octet (c values) packed LSB-first into the low 8*b bits of a word.
__device__ __forceinline__ uint64_t pack_octet(const float v[8], int c, const Meta& m, int b,
                                               int64_t index0, uint32_t key, bool stochastic) {
  uint64_t word = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (j < c) {
      const float u = stochastic ? uniform_from_index(static_cast<uint64_t>(index0 + j), key) : 0.5f;
      const uint32_t q = code_of(v[j], m, u);
      word |= static_cast<uint64_t>(q) << (j * b);
    }
  }
  return word;
}

// Writes the nbytes (<= 8) low bytes of word at data[pos ..], never outside [0, total).
__device__ __forceinline__ void store_bytes(uint8_t* __restrict__ data, int64_t total, int64_t pos,
                                            uint64_t word, int nbytes, int b) {
  if (pos >= 0 && pos <= total - nbytes) {
    uint8_t* dst = data + pos;
    if (nbytes == b && (reinterpret_cast<uintptr_t>(dst) & static_cast<uintptr_t>(b - 1)) == 0) {
      switch (b) {  // little-endian: byte i of the word lands at dst + i
        case 1: *dst = static_cast<uint8_t>(word); break;
        case 2: *reinterpret_cast<uint16_t*>(dst) = static_cast<uint16_t>(word); break;
        case 4: *reinterpret_cast<uint32_t*>(dst) = static_cast<uint32_t>(word); break;
        default: *reinterpret_cast<uint64_t*>(dst) = word; break;
      }
    } else {
      for (int i = 0; i < nbytes; ++i) dst[i] = static_cast<uint8_t>(word >> (8 * i));
    }
  } else {  // only reachable with inconsistent offsets/total: clip
    for (int i = 0; i < nbytes; ++i) {
      if (pos >= 0 && i < total - pos) data[pos + i] = static_cast<uint8_t>(word >> (8 * i));
    }
  }
}

// ------------------------------------------------------------------------------------------------
// quantize
// ------------------------------------------------------------------------------------------------
struct QuantArgs {
  const uint8_t* bits;     // (N,)
  const int64_t* offsets;  // (N + 1,)
  uint8_t* data;           // (total,)
  uint16_t* lo;            // (N, G) bf16 patterns
  uint16_t* step;          // (N, G)
  int64_t N, D, G, group_size, total, pairs;
  uint32_t key;
  int lpg_log2;            // lanes per group = 1 << lpg_log2, in [0, 5]
  bool stochastic;
  bool vec;                // rows start 16-byte aligned and D % 8 == 0: vector loads
};

// NOCT > 0: every lane holds its (at most NOCT) octets in registers between the two passes.
// NOCT == 0: any group size, lanes-per-group 32, values read twice (second read mostly cached).
template <typename T, int NOCT>
__global__ void __launch_bounds__(kThreads)
quantize_kernel(const T* __restrict__ x, const QuantArgs a) {
  const int lane = threadIdx.x & 31;
  const int lpg = 1 << a.lpg_log2;
  const int sub = lane >> a.lpg_log2;  // which pair of the warp's batch
  const int sl = lane & (lpg - 1);     // lane inside the lane group
  const int64_t per_warp = 32 >> a.lpg_log2;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock * per_warp;

  // `base` is warp-uniform, so all 32 lanes run the same iterations and reach every shuffle.
  for (int64_t base = warp * per_warp; base < a.pairs; base += stride) {
    const int64_t p = base + sub;  // pair = n * G + g
    const bool active = p < a.pairs;
    int64_t n = 0, g = 0, glen = 0;
    int b = 0;
    if (active) {
      n = p / a.G;
      g = p - n * a.G;
      glen = min(a.group_size, a.D - g * a.group_size);  // >= 1
      b = a.bits[n];
    }
    const int64_t first = n * a.D + g * a.group_size;  // flat index of the group's first value

    Range r{__uint_as_float(0x7F800000u), __uint_as_float(0xFF800000u), false};
    float v[NOCT > 0 ? NOCT : 1][8];
    if constexpr (NOCT > 0) {
#pragma unroll
      for (int k = 0; k < NOCT; ++k) {
        const int64_t e = 8 * (static_cast<int64_t>(sl) + static_cast<int64_t>(k) * lpg);
        const int c = static_cast<int>(max(static_cast<int64_t>(0), min(static_cast<int64_t>(8), glen - e)));
        load_octet(x, first + e, c, a.vec, v[k]);
        range_add(r, v[k], c);
      }
    } else {
      for (int64_t e = 8 * static_cast<int64_t>(sl); e < glen; e += 8 * static_cast<int64_t>(lpg)) {
        const int c = static_cast<int>(min(static_cast<int64_t>(8), glen - e));
        load_octet(x, first + e, c, a.vec, v[0]);
        range_add(r, v[0], c);
      }
    }
    range_reduce(r, lpg);
    if (!active) continue;  // only in a warp's last iteration; no shuffle follows

    const float lv = static_cast<float>((1u << min(b, 31)) - 1u);
    const Meta m = group_meta_of(r, lv);
    if (sl == 0) {
      a.lo[p] = m.lo_bits;
      a.step[p] = m.step_bits;
    }
    if (valid_width(b)) {  // the reference packs nothing for a row of another width
      // Byte of value (g * group_size + e) of row n: offsets[n] + (g * group_size + e) / 8 * b.
      const int64_t group_byte = a.offsets[n] + (g * (a.group_size >> 3)) * b;
      if constexpr (NOCT > 0) {
#pragma unroll
        for (int k = 0; k < NOCT; ++k) {
          const int64_t e = 8 * (static_cast<int64_t>(sl) + static_cast<int64_t>(k) * lpg);
          if (e < glen) {
            const int c = static_cast<int>(min(static_cast<int64_t>(8), glen - e));
            const uint64_t word = pack_octet(v[k], c, m, b, first + e, a.key, a.stochastic);
            store_bytes(a.data, a.total, group_byte + (e >> 3) * b, word, (c * b + 7) >> 3, b);
          }
        }
      } else {
        for (int64_t e = 8 * static_cast<int64_t>(sl); e < glen; e += 8 * static_cast<int64_t>(lpg)) {
          const int c = static_cast<int>(min(static_cast<int64_t>(8), glen - e));
          load_octet(x, first + e, c, a.vec, v[0]);
          const uint64_t word = pack_octet(v[0], c, m, b, first + e, a.key, a.stochastic);
          store_bytes(a.data, a.total, group_byte + (e >> 3) * b, word, (c * b + 7) >> 3, b);
        }
      }
    }
    // Bytes that belong to no row are zeros, as in the reference: before row 0, and between the
    // end of row n and the start of row n + 1 (or total). Both ranges are empty for the offsets
    // the API builds (reference.row_offsets), so this costs two comparisons per row.
    if (g == a.G - 1) {
      const int64_t row_end = a.offsets[n] + (valid_width(b) ? (a.D * b + 7) / 8 : 0);
      const int64_t next = (n + 1 == a.N) ? a.total : min(a.offsets[n + 1], a.total);
      for (int64_t i = max(row_end, static_cast<int64_t>(0)) + sl; i < next; i += lpg) a.data[i] = 0;
    }
    if (p == 0) {
      const int64_t head = min(a.offsets[0], a.total);
      for (int64_t i = sl; i < head; i += lpg) a.data[i] = 0;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// quantize, lean form (_C.quantize_lean; not yet the default: needs a GPU run to check parity)
// ------------------------------------------------------------------------------------------------
// The H200 profile of quantize_kernel (docs/results.md, GPU): bound by instructions, ~1,085 warp
// instructions per 256-value group (~136 per value and lane), DRAM at 17.8%. This form covers
// the default layout -- one warp per group (32 lanes of one octet: group_size in (128, 256]),
// rows 16-byte aligned with D % 8 == 0 -- with the same results and fewer instructions:
// * the range is a min and a max of order keys (the float's bits, negatives' magnitude bits
//   flipped: monotone in the value, -0.0 below +0.0, as min_ordered/max_ordered order them),
//   and non-finite values are seen in the reduced keys themselves (+Inf/NaN above +Inf's key,
//   -Inf/-NaN below -Inf's): no per-value flag, two shuffles a level instead of three;
// * the code's NaN test is fmaxf's (fmaxf(NaN, 0) is 0, what the test wrote);
// * the hash of value j of an octet is that of the octet's first index xor j (the first index
//   is a multiple of 8), one xor a value before fmix32;
// * the width is a template argument (its shifts, level count and store size constants),
//   dispatched once per group (warp-uniform: one group per warp).
// Lanes of a short last group (c < 8) take the general helpers.
__device__ __forceinline__ int32_t order_key(uint32_t u) {
  return static_cast<int32_t>(u ^ (static_cast<uint32_t>(static_cast<int32_t>(u) >> 31) >> 1));
}
__device__ __forceinline__ float key_value(int32_t k) {  // order_key is its own inverse
  return __uint_as_float(static_cast<uint32_t>(order_key(static_cast<uint32_t>(k))));
}
constexpr int32_t kKeyPosInf = 0x7F800000;                  // order_key(+Inf)
constexpr int32_t kKeyNegInf = static_cast<int32_t>(0x807FFFFFu);  // order_key(-Inf)

template <int B>
__device__ __forceinline__ uint64_t pack_lean(const float v[8], const Meta& m, uint32_t hbase,
                                              bool stochastic) {
  uint64_t word = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float u = stochastic
        ? static_cast<float>(fmix32(hbase ^ static_cast<uint32_t>(j)) >> 8) * (1.0f / 16777216.0f)
        : 0.5f;
    const float t = __fadd_rn(__fmul_rn(__fsub_rn(v[j], m.lo), m.inv), u);
    const float q = fminf(fmaxf(floorf(t), 0.0f), m.lv);
    word |= static_cast<uint64_t>(static_cast<uint32_t>(q)) << (j * B);
  }
  return word;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
quantize_lean_kernel(const T* __restrict__ x, const QuantArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t p = warp; p < a.pairs; p += stride) {  // warp-uniform: one pair per warp
    const int64_t n = p / a.G;
    const int64_t g = p - n * a.G;
    const int64_t glen = min(a.group_size, a.D - g * a.group_size);  // >= 1
    const int b = a.bits[n];
    const int64_t first = n * a.D + g * a.group_size;
    const int64_t e = 8 * static_cast<int64_t>(lane);
    const int c = static_cast<int>(max(static_cast<int64_t>(0), min(static_cast<int64_t>(8), glen - e)));
    float v[8];
    load_octet(x, first + e, c, true, v);  // rows are 16-byte aligned, D % 8 == 0 (a.vec)
    int32_t kmn = INT_MAX, kmx = INT_MIN;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < c) {
        const int32_t k = order_key(__float_as_uint(v[j]));
        kmn = min(kmn, k);
        kmx = max(kmx, k);
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      kmn = min(kmn, __shfl_xor_sync(kFullMask, kmn, off));
      kmx = max(kmx, __shfl_xor_sync(kFullMask, kmx, off));
    }
    const Range r{key_value(kmn), key_value(kmx), kmx >= kKeyPosInf || kmn <= kKeyNegInf};
    const float lv = static_cast<float>((1u << min(b, 31)) - 1u);
    const Meta m = group_meta_of(r, lv);
    if (lane == 0) {
      a.lo[p] = m.lo_bits;
      a.step[p] = m.step_bits;
    }
    if (valid_width(b) && c > 0) {
      const int64_t group_byte = a.offsets[n] + (g * (a.group_size >> 3)) * b;
      const int64_t pos = group_byte + (e >> 3) * b;
      const int nbytes = (c * b + 7) >> 3;
      uint64_t word;
      if (c == 8) {
        const uint64_t i0 = static_cast<uint64_t>(first + e);
        const uint32_t hbase = static_cast<uint32_t>(i0) ^ a.key ^
                               (static_cast<uint32_t>(i0 >> 32) * 0x85EBCA6Bu);
        switch (b) {
          case 1: word = pack_lean<1>(v, m, hbase, a.stochastic); break;
          case 2: word = pack_lean<2>(v, m, hbase, a.stochastic); break;
          case 4: word = pack_lean<4>(v, m, hbase, a.stochastic); break;
          default: word = pack_lean<8>(v, m, hbase, a.stochastic); break;
        }
      } else {
        word = pack_octet(v, c, m, b, first + e, a.key, a.stochastic);
      }
      store_bytes(a.data, a.total, pos, word, nbytes, b);
    }
    // bytes that belong to no row: as quantize_kernel
    if (g == a.G - 1) {
      const int64_t row_end = a.offsets[n] + (valid_width(b) ? (a.D * b + 7) / 8 : 0);
      const int64_t next = (n + 1 == a.N) ? a.total : min(a.offsets[n + 1], a.total);
      for (int64_t i = max(row_end, static_cast<int64_t>(0)) + lane; i < next; i += 32) a.data[i] = 0;
    }
    if (p == 0) {
      const int64_t head = min(a.offsets[0], a.total);
      for (int64_t i = lane; i < head; i += 32) a.data[i] = 0;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// dequantize
// ------------------------------------------------------------------------------------------------
// fp32 result -> out dtype, round to nearest even; NaN -> the positive quiet NaN the CPU produces.
__device__ __forceinline__ void put(float* p, float v) {
  *p = is_nan_f32(v) ? __uint_as_float(0x7FC00000u) : v;
}
__device__ __forceinline__ uint16_t f32_to_half_bits(float v) {
  return is_nan_f32(v) ? static_cast<uint16_t>(0x7E00u) : __half_as_ushort(__float2half_rn(v));
}
__device__ __forceinline__ void put(c10::Half* p, float v) {
  *reinterpret_cast<uint16_t*>(p) = f32_to_half_bits(v);
}
__device__ __forceinline__ void put(c10::BFloat16* p, float v) {
  *reinterpret_cast<uint16_t*>(p) = bf16_from_float(v);
}

template <typename T>
struct St;  // 8 values to a 16-byte aligned address
template <>
struct St<float> {
  static __device__ __forceinline__ void eight(float* p, const float r[8]) {
    float4 a, b;
    a.x = r[0]; a.y = r[1]; a.z = r[2]; a.w = r[3];
    b.x = r[4]; b.y = r[5]; b.z = r[6]; b.w = r[7];
    const uint32_t nan = 0x7FC00000u;
    a.x = is_nan_f32(a.x) ? __uint_as_float(nan) : a.x;
    a.y = is_nan_f32(a.y) ? __uint_as_float(nan) : a.y;
    a.z = is_nan_f32(a.z) ? __uint_as_float(nan) : a.z;
    a.w = is_nan_f32(a.w) ? __uint_as_float(nan) : a.w;
    b.x = is_nan_f32(b.x) ? __uint_as_float(nan) : b.x;
    b.y = is_nan_f32(b.y) ? __uint_as_float(nan) : b.y;
    b.z = is_nan_f32(b.z) ? __uint_as_float(nan) : b.z;
    b.w = is_nan_f32(b.w) ? __uint_as_float(nan) : b.w;
    reinterpret_cast<float4*>(p)[0] = a;
    reinterpret_cast<float4*>(p)[1] = b;
  }
};
template <>
struct St<c10::Half> {
  static __device__ __forceinline__ void eight(c10::Half* p, const float r[8]) {
    uint4 w;
    w.x = f32_to_half_bits(r[0]) | (uint32_t(f32_to_half_bits(r[1])) << 16);
    w.y = f32_to_half_bits(r[2]) | (uint32_t(f32_to_half_bits(r[3])) << 16);
    w.z = f32_to_half_bits(r[4]) | (uint32_t(f32_to_half_bits(r[5])) << 16);
    w.w = f32_to_half_bits(r[6]) | (uint32_t(f32_to_half_bits(r[7])) << 16);
    *reinterpret_cast<uint4*>(p) = w;
  }
};
template <>
struct St<c10::BFloat16> {
  static __device__ __forceinline__ void eight(c10::BFloat16* p, const float r[8]) {
    uint4 w;
    w.x = bf16_from_float(r[0]) | (uint32_t(bf16_from_float(r[1])) << 16);
    w.y = bf16_from_float(r[2]) | (uint32_t(bf16_from_float(r[3])) << 16);
    w.z = bf16_from_float(r[4]) | (uint32_t(bf16_from_float(r[5])) << 16);
    w.w = bf16_from_float(r[6]) | (uint32_t(bf16_from_float(r[7])) << 16);
    *reinterpret_cast<uint4*>(p) = w;
  }
};

struct DequantArgs {
  const uint8_t* data;
  const uint16_t* lo;
  const uint16_t* step;
  const uint8_t* bits;
  const int64_t* offsets;
  int64_t data_len, D, G, group_size, octets_per_row, work;
  bool vec;  // out rows 16-byte aligned, D % 8 == 0, and T has a vector store
};

// Reads the nbytes (<= 8) bytes at data[pos ..] as a little-endian word; bytes outside
// [0, len) read as 0.
__device__ __forceinline__ uint64_t load_bytes(const uint8_t* __restrict__ data, int64_t len,
                                               int64_t pos, int nbytes, int b) {
  uint64_t word = 0;
  if (pos >= 0 && pos <= len - nbytes) {
    const uint8_t* src = data + pos;
    if (nbytes == b && (reinterpret_cast<uintptr_t>(src) & static_cast<uintptr_t>(b - 1)) == 0) {
      switch (b) {
        case 1: return __ldg(src);
        case 2: return __ldg(reinterpret_cast<const unsigned short*>(src));
        case 4: return __ldg(reinterpret_cast<const unsigned int*>(src));
        default: return __ldg(reinterpret_cast<const unsigned long long*>(src));
      }
    }
    for (int i = 0; i < nbytes; ++i) word |= static_cast<uint64_t>(__ldg(src + i)) << (8 * i);
  } else {
    for (int i = 0; i < nbytes; ++i) {
      if (pos >= 0 && i < len - pos) word |= static_cast<uint64_t>(__ldg(data + pos + i)) << (8 * i);
    }
  }
  return word;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
dequantize_kernel(const DequantArgs a, T* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < a.work;
       t += stride) {
    const int64_t n = t / a.octets_per_row;
    const int64_t e = 8 * (t - n * a.octets_per_row);  // first value of the octet in row n
    const int c = static_cast<int>(min(static_cast<int64_t>(8), a.D - e));
    const int64_t gi = n * a.G + e / a.group_size;      // an octet never straddles two groups
    const float lo = bf16_value(a.lo[gi]);
    const float st = bf16_value(a.step[gi]);
    const int b = a.bits[n];
    uint64_t word = 0;  // a row of another width has code 0 everywhere (as in the reference)
    int w = 0;
    if (valid_width(b)) {
      w = b;
      word = load_bytes(a.data, a.data_len, a.offsets[n] + (e >> 3) * b, (c * b + 7) >> 3, b);
    }
    const uint32_t mask = (1u << w) - 1u;
    float r[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float q = static_cast<float>(static_cast<uint32_t>(word >> (j * w)) & mask);
      r[j] = __fadd_rn(__fmul_rn(q, st), lo);
    }
    T* dst = out + n * a.D + e;
    if (a.vec && c == 8) {
      St<T>::eight(dst, r);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (j < c) put(dst + j, r[j]);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// masks
// ------------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(kThreads)
pack_mask_kernel(const uint8_t* __restrict__ mask, int64_t numel, int64_t nbytes, bool vec,
                 uint8_t* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < nbytes;
       i += stride) {
    const int64_t e = 8 * i;
    const int c = static_cast<int>(min(static_cast<int64_t>(8), numel - e));
    uint32_t byte = 0;
    if (vec && c == 8) {
      const uint64_t w = __ldg(reinterpret_cast<const unsigned long long*>(mask + e));
#pragma unroll
      for (int j = 0; j < 8; ++j) byte |= (((w >> (8 * j)) & 0xFFu) != 0 ? 1u : 0u) << j;
    } else {
      for (int j = 0; j < c; ++j) byte |= (__ldg(mask + e + j) != 0 ? 1u : 0u) << j;
    }
    out[i] = static_cast<uint8_t>(byte);
  }
}

__global__ void __launch_bounds__(kThreads)
unpack_mask_kernel(const uint8_t* __restrict__ packed, int64_t numel, uint8_t* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += stride) {
    out[i] = static_cast<uint8_t>((__ldg(packed + (i >> 3)) >> (i & 7)) & 1u);
  }
}

// Fused backward of the 1-bit-mask layers (kernels.h, masked_grad_cpu): one thread per element.
// A pass-through or zero moves the bit pattern (as torch.where); a product is computed as torch's
// CUDA `grad * scalar` / `grad * noise` computes it (float32 opmath for 16-bit types, rounded to
// nearest even by c10's conversion; float64 for float64).
__device__ __forceinline__ float scaled(float x, float s) { return __fmul_rn(x, s); }
__device__ __forceinline__ double scaled(double x, double s) { return __dmul_rn(x, s); }
__device__ __forceinline__ c10::Half scaled(c10::Half x, float s) {
  return c10::Half(__fmul_rn(static_cast<float>(x), s));
}
__device__ __forceinline__ c10::BFloat16 scaled(c10::BFloat16 x, float s) {
  return c10::BFloat16(__fmul_rn(static_cast<float>(x), s));
}

template <typename T, typename S>
__global__ void __launch_bounds__(kThreads)
masked_grad_kernel(const T* __restrict__ grad, const uint8_t* __restrict__ packed, int64_t n,
                   bool on_pass, S on, bool off_zero, S off, T* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const bool m = ((__ldg(packed + (i >> 3)) >> (i & 7)) & 1u) != 0;
    const T x = grad[i];
    if (m ? on_pass : off_zero) {
      out[i] = m ? x : T(0);
    } else {
      out[i] = scaled(x, m ? on : off);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// host side
// ------------------------------------------------------------------------------------------------
// Blocks for `units` work items of `per_block` each: enough to cover them, at most 32 blocks per
// SM (the kernels loop over the rest), never more than gridDim.x allows.
int sm_count() {
  static std::array<std::atomic<int>, 256> cache{};  // per device index, 0 = not queried yet
  const int dev = c10::cuda::current_device();
  if (dev < 0 || dev >= static_cast<int>(cache.size())) return 1;
  int sms = cache[dev].load(std::memory_order_relaxed);
  if (sms == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    cache[dev].store(sms, std::memory_order_relaxed);
  }
  return sms;
}

unsigned grid_for(int64_t units, int64_t per_block) {
  const int64_t need = (units + per_block - 1) / per_block;
  const int64_t sms = sm_count();
  const int64_t cap = std::max<int64_t>(1, sms) * 32;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min({need, cap, static_cast<int64_t>(INT_MAX)})));
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

void check_on(const at::Tensor& t, const at::Tensor& like, const char* fn, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device(), fn, ": ", name, " must be on ",
              like.device(), ", got ", t.device());
}

void check_rows(const char* fn, const at::Tensor& ref, const at::Tensor& bits,
                const at::Tensor& offsets, int64_t n_rows) {
  check_on(bits, ref, fn, "bits");
  check_on(offsets, ref, fn, "offsets");
  TORCH_CHECK(bits.scalar_type() == at::kByte && bits.dim() == 1 && bits.size(0) == n_rows, fn,
              ": bits must be uint8 of shape (", n_rows, ",), got ", bits.scalar_type(), " of ",
              bits.dim(), " dims");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1 &&
              offsets.size(0) == n_rows + 1, fn, ": offsets must be int64 of shape (",
              n_rows + 1, ",), got ", offsets.scalar_type(), " of ", offsets.dim(), " dims");
}

void check_group_size(const char* fn, int64_t group_size) {
  TORCH_CHECK(group_size > 0 && group_size % 8 == 0, fn,
              ": group_size must be a positive multiple of 8, got ", group_size);
}

int64_t groups_per_row(int64_t d, int64_t group_size) {
  return d == 0 ? 0 : (d - 1) / group_size + 1;  // no overflow for any group_size
}

// The three dtypes of the contract (kernels.h; the CPU twin accepts the same ones).
template <typename F>
void dispatch_float(at::ScalarType t, const char* fn, const char* name, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(c10::Half{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    default: TORCH_CHECK(false, fn, ": ", name, " must be float32, float16 or bfloat16, got ", t);
  }
}

// The codes' layout for a kernel that reads them octet by octet (lo unset, no vector stores).
DequantArgs dequant_args(const at::Tensor& data_c, const at::Tensor& step_c,
                         const at::Tensor& bits_c, const at::Tensor& offsets_c, int64_t D,
                         int64_t G, int64_t group_size) {
  DequantArgs a;
  a.data = data_c.data_ptr<uint8_t>();
  a.lo = nullptr;
  a.step = reinterpret_cast<const uint16_t*>(step_c.data_ptr<at::BFloat16>());
  a.bits = bits_c.data_ptr<uint8_t>();
  a.offsets = offsets_c.data_ptr<int64_t>();
  a.data_len = data_c.numel();
  a.D = D;
  a.G = G;
  a.group_size = group_size;
  a.octets_per_row = (D + 7) / 8;
  a.work = bits_c.size(0) * a.octets_per_row;
  a.vec = false;
  return a;
}

template <typename T, int NOCT>
void launch_quantize(const T* x, const QuantArgs& a, cudaStream_t stream) {
  const int64_t per_block = static_cast<int64_t>(kWarpsPerBlock) * (32 >> a.lpg_log2);
  quantize_kernel<T, NOCT><<<grid_for(a.pairs, per_block), kThreads, 0, stream>>>(x, a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void check_not_capturing(const char* fn) {
  TORCH_CHECK(c10::cuda::currentStreamCaptureStatusMayInitCtx() ==
                  c10::cuda::CaptureStatus::None,
              fn, ": stochastic rounding cannot be captured into a CUDA graph: its seed is "
              "drawn on the host, so every replay would round alike and the compressed "
              "activations would no longer be unbiased. Use torch.compile without CUDA graphs "
              "(mode=\"default\" or \"max-autotune-no-cudagraphs\") or rounding=\"nearest\".");
}

// Arguments are checked on the host as far as that needs no device synchronisation: the values
// of bits and offsets live on the GPU and are not read back. The kernels never access memory
// outside data[0, total) (or data's length) whatever they hold; a width outside {1, 2, 4, 8}
// packs nothing (codes 0), like the reference.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cuda(
    const at::Tensor& x2d, const at::Tensor& bits, const at::Tensor& offsets, int64_t total,
    int64_t group_size, int64_t seed, bool stochastic, bool lean) {
  constexpr const char* fn = "quantize_cuda";
  TORCH_CHECK(x2d.is_cuda(), fn, ": x2d must be a CUDA tensor, got ", x2d.device());
  TORCH_CHECK(x2d.dim() == 2, fn, ": x2d must be 2-d (N, D), got ", x2d.dim(), " dims");
  TORCH_CHECK(x2d.is_contiguous(), fn, ": x2d must be contiguous");
  const int64_t N = x2d.size(0), D = x2d.size(1);
  check_rows(fn, x2d, bits, offsets, N);
  check_group_size(fn, group_size);
  TORCH_CHECK(total >= 0, fn, ": total must be >= 0, got ", total);
  dispatch_float(x2d.scalar_type(), fn, "x2d", [](auto) {});
  if (stochastic) check_not_capturing(fn);

  const c10::cuda::CUDAGuard guard(x2d.device());
  const int64_t G = groups_per_row(D, group_size);
  const auto meta_opts = x2d.options().dtype(at::kBFloat16);
  at::Tensor lo = at::empty({N, G}, meta_opts);
  at::Tensor step = at::empty({N, G}, meta_opts);
  const int64_t pairs = N * G;
  if (pairs == 0) return {at::zeros({total}, x2d.options().dtype(at::kByte)), lo, step};
  // The kernel writes every byte of [0, total): each row's bytes, and zeros wherever no row is.
  at::Tensor data = at::empty({total}, x2d.options().dtype(at::kByte));
  const at::Tensor bits_c = bits.contiguous();
  const at::Tensor offsets_c = offsets.contiguous();

  // Lanes per group: enough for one octet each, at most a warp; then octets per lane.
  const int64_t octets = group_size / 8;
  int lpg_log2 = 0;
  while (lpg_log2 < 5 && (int64_t{1} << lpg_log2) < octets) ++lpg_log2;
  const int64_t lanes = int64_t{1} << lpg_log2;
  const int64_t per_lane = (octets - 1) / lanes + 1;
  const int noct = per_lane == 1 ? 1 : per_lane == 2 ? 2 : per_lane <= kMaxCachedOctets ? 4 : 0;

  QuantArgs a;
  a.bits = bits_c.data_ptr<uint8_t>();
  a.offsets = offsets_c.data_ptr<int64_t>();
  a.data = data.data_ptr<uint8_t>();
  a.lo = reinterpret_cast<uint16_t*>(lo.data_ptr<at::BFloat16>());
  a.step = reinterpret_cast<uint16_t*>(step.data_ptr<at::BFloat16>());
  a.N = N;
  a.D = D;
  a.G = G;
  a.group_size = group_size;
  a.total = total;
  a.pairs = pairs;
  a.key = seed_key(static_cast<uint32_t>(seed));
  a.lpg_log2 = lpg_log2;
  a.stochastic = stochastic;
  a.vec = (D % 8 == 0) && aligned16(x2d.data_ptr());

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float(x2d.scalar_type(), fn, "x2d", [&](auto tag) {
    using T = decltype(tag);
    const T* x = x2d.data_ptr<T>();
    if (lean && noct == 1 && lpg_log2 == 5 && a.vec) {  // one warp per group, vector loads
      const int64_t per_block = kWarpsPerBlock;
      quantize_lean_kernel<T><<<grid_for(a.pairs, per_block), kThreads, 0, stream>>>(x, a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
    switch (noct) {
      case 1: launch_quantize<T, 1>(x, a, stream); break;
      case 2: launch_quantize<T, 2>(x, a, stream); break;
      case 4: launch_quantize<T, 4>(x, a, stream); break;
      default: launch_quantize<T, 0>(x, a, stream); break;
    }
  });
  return {data, lo, step};
}

at::Tensor dequantize_cuda(const at::Tensor& data, const at::Tensor& lo, const at::Tensor& step,
                           const at::Tensor& bits, const at::Tensor& offsets, int64_t group_size,
                           at::Tensor& out) {
  constexpr const char* fn = "dequantize_cuda";
  TORCH_CHECK(out.is_cuda(), fn, ": out must be a CUDA tensor, got ", out.device());
  TORCH_CHECK(out.dim() == 2, fn, ": out must be 2-d (N, D), got ", out.dim(), " dims");
  TORCH_CHECK(out.is_contiguous(), fn, ": out must be contiguous");
  dispatch_float(out.scalar_type(), fn, "out", [](auto) {});
  check_on(data, out, fn, "data");
  check_on(lo, out, fn, "lo");
  check_on(step, out, fn, "step");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 1, fn,
              ": data must be a 1-d uint8 tensor, got ", data.scalar_type(), " of ", data.dim(),
              " dims");
  check_group_size(fn, group_size);
  const int64_t N = out.size(0), D = out.size(1);
  const int64_t G = groups_per_row(D, group_size);
  check_rows(fn, out, bits, offsets, N);
  for (const at::Tensor* t : {&lo, &step}) {
    const char* name = t == &lo ? "lo" : "step";
    TORCH_CHECK(t->scalar_type() == at::kBFloat16, fn, ": ", name, " must be bfloat16, got ",
                t->scalar_type());
    TORCH_CHECK(t->dim() == 2 && t->size(0) == N && t->size(1) == G, fn, ": ", name,
                " must have shape (", N, ", ", G, "), got ", t->dim(), " dims");
  }
  const int64_t octets_per_row = (D + 7) / 8;
  const int64_t work = N * octets_per_row;
  if (work == 0) return out;

  const c10::cuda::CUDAGuard guard(out.device());
  const at::Tensor data_c = data.contiguous();
  const at::Tensor lo_c = lo.contiguous();
  const at::Tensor step_c = step.contiguous();
  const at::Tensor bits_c = bits.contiguous();
  const at::Tensor offsets_c = offsets.contiguous();
  DequantArgs a = dequant_args(data_c, step_c, bits_c, offsets_c, D, G, group_size);
  a.lo = reinterpret_cast<const uint16_t*>(lo_c.data_ptr<at::BFloat16>());
  a.vec = (D % 8 == 0) && aligned16(out.data_ptr());

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float(out.scalar_type(), fn, "out", [&](auto tag) {
    using T = decltype(tag);
    dequantize_kernel<T><<<grid_for(work, kThreads), kThreads, 0, stream>>>(a, out.data_ptr<T>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor pack_mask_cuda(const at::Tensor& mask) {
  constexpr const char* fn = "pack_mask_cuda";
  TORCH_CHECK(mask.is_cuda(), fn, ": mask must be a CUDA tensor, got ", mask.device());
  TORCH_CHECK(mask.scalar_type() == at::kBool, fn, ": mask must be bool, got ", mask.scalar_type());
  TORCH_CHECK(mask.is_contiguous(), fn, ": mask must be contiguous");
  const c10::cuda::CUDAGuard guard(mask.device());
  const int64_t numel = mask.numel();
  const int64_t nbytes = (numel + 7) / 8;
  at::Tensor out = at::empty({nbytes}, mask.options().dtype(at::kByte));
  if (nbytes == 0) return out;
  const uint8_t* m = reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>());
  const bool vec = (reinterpret_cast<uintptr_t>(m) & 7u) == 0;
  pack_mask_kernel<<<grid_for(nbytes, kThreads), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      m, numel, nbytes, vec, out.data_ptr<uint8_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor unpack_mask_cuda(const at::Tensor& packed, int64_t numel) {
  constexpr const char* fn = "unpack_mask_cuda";
  TORCH_CHECK(packed.is_cuda(), fn, ": packed must be a CUDA tensor, got ", packed.device());
  TORCH_CHECK(packed.scalar_type() == at::kByte, fn, ": packed must be uint8, got ",
              packed.scalar_type());
  TORCH_CHECK(packed.is_contiguous(), fn, ": packed must be contiguous");
  TORCH_CHECK(numel >= 0, fn, ": numel must be >= 0, got ", numel);
  TORCH_CHECK(packed.numel() == (numel + 7) / 8, fn, ": packed mask of ", packed.numel(),
              " bytes does not hold ", numel, " values (needs ", (numel + 7) / 8, ")");
  const c10::cuda::CUDAGuard guard(packed.device());
  at::Tensor out = at::empty({numel}, packed.options().dtype(at::kBool));
  if (numel == 0) return out;
  unpack_mask_kernel<<<grid_for(numel, kThreads), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      packed.data_ptr<uint8_t>(), numel, reinterpret_cast<uint8_t*>(out.data_ptr<bool>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor masked_grad_cuda(const at::Tensor& grad, const at::Tensor& packed,
                            std::optional<double> on, std::optional<double> off) {
  constexpr const char* fn = "masked_grad_cuda";
  TORCH_CHECK(grad.is_cuda(), fn, ": grad must be a CUDA tensor, got ", grad.device());
  check_on(packed, grad, fn, "packed");
  TORCH_CHECK(grad.is_contiguous(), fn, ": grad must be contiguous");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 1 && packed.is_contiguous(),
              fn, ": packed must be a contiguous 1-d uint8 tensor, got ", packed.scalar_type(),
              " of ", packed.dim(), " dims");
  const int64_t n = grad.numel();
  TORCH_CHECK(packed.numel() == (n + 7) / 8, fn, ": packed mask of ", packed.numel(),
              " bytes does not hold ", n, " values (needs ", (n + 7) / 8, ")");
  const c10::cuda::CUDAGuard guard(grad.device());
  at::Tensor out = at::empty_like(grad, at::MemoryFormat::Contiguous);
  if (n == 0) return out;
  const bool on_pass = !on.has_value(), off_zero = !off.has_value();
  const double on_v = on.value_or(1.0), off_v = off.value_or(0.0);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const unsigned grid = grid_for(n, kThreads);
  const uint8_t* p = packed.data_ptr<uint8_t>();
  if (grad.scalar_type() == at::kDouble) {
    masked_grad_kernel<double, double><<<grid, kThreads, 0, stream>>>(
        grad.data_ptr<double>(), p, n, on_pass, on_v, off_zero, off_v, out.data_ptr<double>());
  } else {
    dispatch_float(grad.scalar_type(), fn, "grad", [&](auto tag) {
      using T = decltype(tag);
      masked_grad_kernel<T, float><<<grid, kThreads, 0, stream>>>(
          grad.data_ptr<T>(), p, n, on_pass, static_cast<float>(on_v), off_zero,
          static_cast<float>(off_v), out.data_ptr<T>());
    });
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace actnn_zoo
