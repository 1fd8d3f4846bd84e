// CPU kernels of actnn_zoo._C: the compiled twins of actnn_zoo/quant/reference.py.
//
// Work is split over (row, group) pairs. Because group_size is a multiple of 8, every group
// starts on a byte boundary at every width, so each pair owns its own bytes of the output and
// the result does not depend on how pairs are spread over threads. The random number of an
// element is a function of its index only.
//
// The hot loops run over blocks of at most a few hundred values with no data-dependent
// branches and carry `#pragma omp simd` (we build with -fopenmp), so gcc vectorises them under
// -O3 -march=native (check with -fopt-info-vec). -ffp-contract=off keeps every fp32 operation
// separately rounded, as in the reference.
#include "kernels.h"
#include "half_cpu.h"
#include "codes_cpu.h"
#include "decode_cpu.h"
#include "isa_cpu.h"
#include "pages_cpu.h"
#include "tasks_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace actnn_zoo {
namespace {

constexpr int kBlock = 256;           // values per quantization block (codes kept in L1)

// ---------------------------------------------------------------------------------------------
// Loading blocks of input as float32 (float16/bfloat16 converted exactly)
// ---------------------------------------------------------------------------------------------
AZ_INLINE void load_block(const c10::BFloat16* src, int n, float* __restrict buf) {
  const uint16_t* __restrict s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int e = 0; e < n; ++e) buf[e] = bf16_value(s[e]);
}
AZ_INLINE void load_block(const c10::Half* src, int n, float* __restrict buf) {
  int e = 0;
#if defined(__AVX512F__)
  for (; e + 16 <= n; e += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + e));
    _mm512_storeu_ps(buf + e, _mm512_cvtph_ps(h));
  }
#elif defined(__F16C__)
  for (; e + 8 <= n; e += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + e));
    _mm256_storeu_ps(buf + e, _mm256_cvtph_ps(h));
  }
#endif
  const uint16_t* __restrict s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int i = e; i < n; ++i) buf[i] = half_value(s[i]);  // exact either way
}

// ---------------------------------------------------------------------------------------------
// Quantization
// ---------------------------------------------------------------------------------------------
// Running min, max and a NaN detector over n floats: v * 0 is NaN exactly for Inf/NaN, and a
// sum holding one NaN is NaN. The lane-wise `a < m ? a : m` never lets NaN into m.
struct Range {
  float mn = INFINITY, mx = -INFINITY, bad = 0.0f;
};
AZ_INLINE void range_update(const float* __restrict v, int n, Range& r) {
  float mn = r.mn, mx = r.mx, bad = r.bad;
#pragma omp simd reduction(min : mn) reduction(max : mx) reduction(+ : bad)
  for (int k = 0; k < n; ++k) {
    const float a = v[k];
    mn = a < mn ? a : mn;
    mx = a > mx ? a : mx;
    bad = bad + a * 0.0f;
  }
  r.mn = mn;
  r.mx = mx;
  r.bad = bad;
}

// n <= kBlock input values as float32, padded with copies of the first value up to n16, a
// multiple of 16 (neutral for the range; the padding's codes are discarded).
template <typename T>
AZ_INLINE const float* padded_block(const T* x, int n, int n16, float* __restrict buf) {
  if constexpr (std::is_same<T, float>::value) {
    if (n == n16) return x;
    std::memcpy(buf, x, n * sizeof(float));
  } else {
    load_block(x, n, buf);
  }
  for (int k = n; k < n16; ++k) buf[k] = buf[0];
  return buf;
}

// The block quantize_group codes: padded_block of x, or with an affine map applied on the way
// (kAffine: (x - shift) * scale in float32, two roundings, as torch computes a normalized copy
// (x - mean) * invstd), so the mapped tensor never exists whole. Position p of a row takes
// shift[p / block] and scale[p / block] (quantize_impl offsets both by row * row_stride): one
// pair per channel of a batch norm (row_stride 0, block = the map's size), per position of a
// layer norm's rows (row_stride = rows of a sample, block = the normalized size).
struct Affine {
  const float* shift = nullptr;  // null: no map
  const float* scale = nullptr;
  int64_t row_stride = 0;  // statistics per row (sample) of the quantizer
  int64_t block = 1;       // consecutive positions sharing one pair
};

template <typename T, bool kAffine>
AZ_INLINE const float* group_block(const T* x, const Affine& a, int64_t pos, int n, int n16,
                                   float* __restrict buf) {
  if constexpr (!kAffine) {
    return padded_block(x, n, n16, buf);
  } else {
    if constexpr (std::is_same<T, float>::value) {
      std::memcpy(buf, x, static_cast<size_t>(n) * sizeof(float));
    } else {
      load_block(x, n, buf);
    }
    for (int k = 0; k < n;) {  // runs of positions sharing one pair
      const int64_t p = pos + k;
      const int64_t seg = p / a.block;
      const int run = static_cast<int>(std::min<int64_t>(n - k, (seg + 1) * a.block - p));
      const float m = a.shift[seg], sc = a.scale[seg];
      float* __restrict v = buf + k;
#pragma omp simd
      for (int j = 0; j < run; ++j) v[j] = (v[j] - m) * sc;
      k += run;
    }
    for (int k = n; k < n16; ++k) buf[k] = buf[0];
    return buf;
  }
}

// One group of len values (len > 0) at element index i0; writes ceil(len * B / 8) bytes.
template <typename T, int B, bool kStochastic, bool kAffine>
void quantize_group(const T* x, int64_t len, uint64_t i0, uint32_t key, uint8_t* out,
                    uint16_t* lo_out, uint16_t* step_out, const Affine& a, int64_t pos) {
  alignas(64) float buf[kBlock];
  // Pass 1: the range. A group of one block keeps it loaded (converted, mapped) for pass 2.
  const float* loaded = nullptr;
  Range r;
  for (int64_t e = 0; e < len; e += kBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kBlock, len - e));
    const int n16 = (n + 15) & ~15;
    const float* v = group_block<T, kAffine>(x + e, a, pos + e, n, n16, buf);
    if (len <= kBlock) loaded = v;
    range_update(v, n16, r);
  }
  constexpr float kLevels = static_cast<float>((1 << B) - 1);
  const GroupMeta meta = group_meta(r.mn, r.mx, r.bad == 0.0f, kLevels);
  *lo_out = meta.lo;
  *step_out = meta.step;
  if (meta.bad) {
    std::memset(out, 0, static_cast<size_t>(row_bytes(len, B)));
    return;
  }

  // Pass 2 (the group is in cache now): codes from the stored bf16 values, block by block.
  alignas(64) int32_t codes32[kBlock];
  alignas(64) uint8_t codes[kBlock + 8];
  const float lo = bf16_value(meta.lo);
  const float step = bf16_value(meta.step);
  const float inv = step > 0.0f ? 1.0f / step : 0.0f;
  for (int64_t e = 0; e < len; e += kBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kBlock, len - e));
    const int n16 = (n + 15) & ~15;
    const float* v = loaded != nullptr ? loaded
                                       : group_block<T, kAffine>(x + e, a, pos + e, n, n16, buf);
    code_block<kStochastic>(v, n16, lo, inv, kLevels, i0 + static_cast<uint64_t>(e), key,
                            codes32);
#pragma omp simd
    for (int k = 0; k < n16; ++k) codes[k] = static_cast<uint8_t>(codes32[k]);
    // A row's last group may end inside a byte: its unused high bits are 0.
    std::memset(codes + n, 0, 8);
    pack_block<B>(codes, (n * B + 7) / 8, out + e * B / 8);
  }
}

template <typename T, bool kStochastic, bool kAffine>
void quantize_group_any(int b, const T* x, int64_t len, uint64_t i0, uint32_t key, uint8_t* out,
                        uint16_t* lo, uint16_t* step, const Affine& a, int64_t pos) {
  switch (b) {
    case 1: quantize_group<T, 1, kStochastic, kAffine>(x, len, i0, key, out, lo, step, a, pos); break;
    case 2: quantize_group<T, 2, kStochastic, kAffine>(x, len, i0, key, out, lo, step, a, pos); break;
    case 4: quantize_group<T, 4, kStochastic, kAffine>(x, len, i0, key, out, lo, step, a, pos); break;
    default: quantize_group<T, 8, kStochastic, kAffine>(x, len, i0, key, out, lo, step, a, pos); break;
  }
}

// Groups per parallel task: enough work (~32K values) to amortise the scheduling.
inline int64_t group_grain(int64_t group_size) {
  return std::max<int64_t>(1, (int64_t{1} << 15) / group_size);
}

template <typename T, bool kStochastic, bool kAffine>
void quantize_impl(const T* x, int64_t n_rows, int64_t d, int64_t group_size, const uint8_t* bits,
                   const int64_t* offsets, uint32_t key, uint8_t* data, uint16_t* lo,
                   uint16_t* step, const Affine& a) {
  const int64_t g_per_row = (d + group_size - 1) / group_size;
  parallel_tasks(n_rows * g_per_row, group_grain(group_size), [&](int64_t begin, int64_t end) {
    for (int64_t id = begin; id < end; ++id) {
      const int64_t n = id / g_per_row;
      const int64_t g = id - n * g_per_row;
      const int b = bits[n];
      const int64_t start = g * group_size;
      const int64_t len = std::min(group_size, d - start);
      Affine row = a;  // this row's statistics
      if constexpr (kAffine) {
        row.shift = a.shift + n * a.row_stride;
        row.scale = a.scale + n * a.row_stride;
      }
      quantize_group_any<T, kStochastic, kAffine>(
          b, x + n * d + start, len, static_cast<uint64_t>(n * d + start), key,
          data + offsets[n] + start * b / 8, lo + id, step + id, row, start);
    }
  });
}

template <typename TO>
void dequantize_impl(const uint8_t* data, const uint16_t* lo, const uint16_t* step,
                     const uint8_t* bits, const int64_t* offsets, int64_t n_rows, int64_t d,
                     int64_t group_size, TO* out) {
  const int64_t g_per_row = (d + group_size - 1) / group_size;
  parallel_tasks(n_rows * g_per_row, group_grain(group_size), [&](int64_t begin, int64_t end) {
    for (int64_t id = begin; id < end; ++id) {
      const int64_t n = id / g_per_row;
      const int64_t g = id - n * g_per_row;
      const int b = bits[n];
      const int64_t start = g * group_size;
      const int64_t len = std::min(group_size, d - start);
      dequantize_group_any<TO>(b, data + offsets[n] + start * b / 8, len, bf16_value(lo[id]),
                               step[id], out + n * d + start);
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Argument checks shared by quantize and dequantize
// ---------------------------------------------------------------------------------------------
void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got one on ", t.device());
}

}  // namespace

void check_group_size(int64_t group_size) {
  TORCH_CHECK_VALUE(group_size > 0 && group_size % 8 == 0,
                    "group_size must be a positive multiple of 8, got ", group_size);
}

// bits (N,) uint8 in {1,2,4,8}; offsets (N+1,) int64; every row's bytes inside [0, limit).
// With `ordered` (quantize, which writes), rows must also come in order without overlapping,
// so that no two groups write the same byte. Returns true when the rows lie back to back from
// byte 0 (no gaps before or between them; there may be unused bytes after the last row).
bool check_rows(const at::Tensor& bits, const at::Tensor& offsets, int64_t n_rows, int64_t d,
                int64_t limit, const char* limit_name, bool ordered) {
  check_cpu(bits, "bits");
  check_cpu(offsets, "offsets");
  TORCH_CHECK(bits.scalar_type() == at::kByte, "bits must be uint8, got ", bits.scalar_type());
  TORCH_CHECK(bits.dim() == 1 && bits.size(0) == n_rows, "bits must have shape (", n_rows,
              ",), got ", bits.sizes());
  TORCH_CHECK(bits.is_contiguous(), "bits must be contiguous");
  TORCH_CHECK(offsets.scalar_type() == at::kLong, "offsets must be int64, got ",
              offsets.scalar_type());
  TORCH_CHECK(offsets.dim() == 1 && offsets.size(0) == n_rows + 1, "offsets must have shape (",
              n_rows + 1, ",), got ", offsets.sizes());
  TORCH_CHECK(offsets.is_contiguous(), "offsets must be contiguous");
  TORCH_CHECK_VALUE(d <= (int64_t{1} << 59), "rows of ", d, " values are too long");
  const uint8_t* b = bits.data_ptr<uint8_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  bool tiled = off[0] == 0;
  for (int64_t n = 0; n < n_rows; ++n) {
    const int w = b[n];
    TORCH_CHECK_VALUE(w == 1 || w == 2 || w == 4 || w == 8, "bits[", n,
                      "] must be 1, 2, 4 or 8, got ", w);
    const int64_t nb = row_bytes(d, w);
    TORCH_CHECK_VALUE(off[n] >= 0 && off[n] <= limit - nb, "row ", n, " (", nb,
                      " bytes at offset ", off[n], ") does not fit in ", limit_name, " (", limit,
                      " bytes)");
    // off[n] + nb <= limit here, so the sums below do not overflow.
    TORCH_CHECK_VALUE(!ordered || off[n + 1] >= off[n] + nb, "offsets must increase by at "
                      "least each row's size: row ", n, " has ", nb, " bytes at offset ", off[n],
                      " but the next row starts at ", off[n + 1]);
    tiled = tiled && off[n + 1] == off[n] + nb;
  }
  return tiled;
}

namespace {

bool is_float_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The kernel interface (kernels.h)
// ---------------------------------------------------------------------------------------------
namespace {

// x: contiguous float32/16 or bfloat16 on the CPU; `two_d`: of shape (N, D), else any shape
// read as the contract's rows (contract_rows).
void check_x(const at::Tensor& x, int64_t group_size, bool two_d) {
  const char* name = two_d ? "x2d" : "x";
  check_cpu(x, name);
  TORCH_CHECK(is_float_type(x.scalar_type()), name,
              " must be float32, float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(!two_d || x.dim() == 2, "x2d must be 2-d (N, D), got shape ", x.sizes());
  TORCH_CHECK(x.is_contiguous(), name, " must be contiguous");
  check_group_size(group_size);
}

// One width for every row, rows back to back from row `first`: the layout quantize_uniform and
// dequantize_uniform use, made in this call's memory instead of as two tensors (two allocations
// and a fill per quantize and per dequantize, ~1 us each on a tiny tensor).
struct UniformRows {
  std::vector<uint8_t> bits;
  std::vector<int64_t> offsets;
  UniformRows(int64_t n, int64_t d, int64_t width, int64_t first)
      : bits(static_cast<size_t>(n), static_cast<uint8_t>(width)),
        offsets(static_cast<size_t>(n + 1)) {
    const int64_t rb = row_bytes(d, static_cast<int>(width));
    for (int64_t r = 0; r <= n; ++r) offsets[static_cast<size_t>(r)] = (first + r) * rb;
  }
};

void check_width(int64_t bits) {
  TORCH_CHECK_VALUE(bits == 1 || bits == 2 || bits == 4 || bits == 8,
                    "bits must be 1, 2, 4 or 8, got ", bits);
}

// The work of the quantize entries once their arguments are checked: rows of widths `b` at
// byte offsets `off` (inside [0, total), in order); `tiled`: back to back from byte 0.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_checked(
    const at::Tensor& x2d, int64_t n_rows, int64_t d, const uint8_t* b, const int64_t* off,
    int64_t total, bool tiled, int64_t group_size, int64_t seed, bool stochastic,
    const Affine& affine) {
  const int64_t g_per_row = (d + group_size - 1) / group_size;

  // Bytes outside every row are zeros in the reference. Rows back to back: only the tail after
  // the last row (a capacity bound larger than the rows, see SampleBits) needs clearing.
  at::Tensor data = tiled ? at::empty({total}, x2d.options().dtype(at::kByte))
                          : at::zeros({total}, x2d.options().dtype(at::kByte));
  if (tiled) {
    const int64_t end = off[n_rows];
    if (end < total) std::memset(data.data_ptr<uint8_t>() + end, 0, total - end);
  }
  at::Tensor lo = at::empty({n_rows, g_per_row}, x2d.options().dtype(at::kBFloat16));
  at::Tensor step = at::empty({n_rows, g_per_row}, x2d.options().dtype(at::kBFloat16));
  if (n_rows == 0 || d == 0) return {data, lo, step};

  const uint32_t key = seed_key(static_cast<uint32_t>(seed));
  uint8_t* out = data.data_ptr<uint8_t>();
  uint16_t* lo_p = reinterpret_cast<uint16_t*>(lo.data_ptr<at::BFloat16>());
  uint16_t* step_p = reinterpret_cast<uint16_t*>(step.data_ptr<at::BFloat16>());

  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* x = x2d.data_ptr<T>();
    const bool mapped = affine.shift != nullptr;
    if (stochastic && mapped) {
      quantize_impl<T, true, true>(x, n_rows, d, group_size, b, off, key, out, lo_p, step_p,
                                   affine);
    } else if (stochastic) {
      quantize_impl<T, true, false>(x, n_rows, d, group_size, b, off, key, out, lo_p, step_p,
                                    affine);
    } else if (mapped) {
      quantize_impl<T, false, true>(x, n_rows, d, group_size, b, off, key, out, lo_p, step_p,
                                    affine);
    } else {
      quantize_impl<T, false, false>(x, n_rows, d, group_size, b, off, key, out, lo_p, step_p,
                                     affine);
    }
  };
  switch (x2d.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: run(c10::BFloat16{}); break;
  }
  return {data, lo, step};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows_cpu(
    const at::Tensor& x2d, const at::Tensor& bits, const at::Tensor& offsets, int64_t total,
    int64_t group_size, int64_t seed, bool stochastic, const Affine& affine) {
  check_x(x2d, group_size, true);
  TORCH_CHECK_VALUE(total >= 0, "total must be >= 0, got ", total);
  const int64_t n_rows = x2d.size(0), d = x2d.size(1);
  const bool tiled = check_rows(bits, offsets, n_rows, d, total, "total", true);
  TORCH_CHECK_VALUE(offsets.data_ptr<int64_t>()[n_rows] <= total, "offsets[N] (",
                    offsets.data_ptr<int64_t>()[n_rows], ") must be at most total (", total, ")");
  return quantize_checked(x2d, n_rows, d, bits.data_ptr<uint8_t>(),
                          offsets.data_ptr<int64_t>(), total, tiled, group_size, seed,
                          stochastic, affine);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_uniform_rows_cpu(
    const at::Tensor& x, int64_t bits, int64_t group_size, int64_t seed, bool stochastic,
    const Affine& affine) {
  check_x(x, group_size, affine.shift != nullptr);
  check_width(bits);
  const auto [n_rows, d] = contract_rows(x.sizes());
  TORCH_CHECK_VALUE(d <= (int64_t{1} << 59), "rows of ", d, " values are too long");
  const UniformRows rows(n_rows, d, bits, 0);
  return quantize_checked(x, n_rows, d, rows.bits.data(), rows.offsets.data(),
                          n_rows * row_bytes(d, static_cast<int>(bits)), true, group_size, seed,
                          stochastic, affine);
}

// The norms' statistics as quantize_affine reads them, checked.
Affine affine_of(const at::Tensor& x2d, const at::Tensor& shift, const at::Tensor& scale,
                 int64_t row_stride, int64_t block) {
  TORCH_CHECK_VALUE(x2d.dim() == 2, "x2d must be 2-d (N, D), got shape ", x2d.sizes());
  const int64_t n = x2d.size(0), d = x2d.size(1);
  TORCH_CHECK_VALUE(block >= 1 && row_stride >= 0, "block must be >= 1 and row_stride >= 0, got ",
                    block, " and ", row_stride);
  // pairs read: rows 0..N-1 at row * row_stride, positions 0..D-1 at p / block
  const int64_t need = n == 0 || d == 0 ? 0 : (n - 1) * row_stride + (d - 1) / block + 1;
  for (const at::Tensor* t : {&shift, &scale}) {
    TORCH_CHECK_VALUE(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 1 &&
                          t->numel() >= need && t->is_contiguous(),
                      "shift and scale must be contiguous 1-d float32 CPU tensors of at least ",
                      need, " values (row_stride ", row_stride, ", block ", block, ")");
  }
  return Affine{shift.data_ptr<float>(), scale.data_ptr<float>(), row_stride, block};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cpu(
    const at::Tensor& x2d, const at::Tensor& bits, const at::Tensor& offsets, int64_t total,
    int64_t group_size, int64_t seed, bool stochastic) {
  return quantize_rows_cpu(x2d, bits, offsets, total, group_size, seed, stochastic, Affine{});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_uniform_cpu(
    const at::Tensor& x, int64_t bits, int64_t group_size, int64_t seed, bool stochastic) {
  return quantize_uniform_rows_cpu(x, bits, group_size, seed, stochastic, Affine{});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_affine_uniform_cpu(
    const at::Tensor& x2d, const at::Tensor& shift, const at::Tensor& scale, int64_t row_stride,
    int64_t block, int64_t bits, int64_t group_size, int64_t seed, bool stochastic) {
  return quantize_uniform_rows_cpu(x2d, bits, group_size, seed, stochastic,
                                   affine_of(x2d, shift, scale, row_stride, block));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_affine_cpu(
    const at::Tensor& x2d, const at::Tensor& shift, const at::Tensor& scale, int64_t row_stride,
    int64_t block, const at::Tensor& bits, const at::Tensor& offsets, int64_t total,
    int64_t group_size, int64_t seed, bool stochastic) {
  return quantize_rows_cpu(x2d, bits, offsets, total, group_size, seed, stochastic,
                           affine_of(x2d, shift, scale, row_stride, block));
}

namespace {

// out: contiguous float on the CPU, (N, D) when `two_d`, else any shape (contract_rows).
void check_out_and_data(const at::Tensor& data, const at::Tensor& out, int64_t group_size,
                        bool two_d) {
  check_cpu(out, "out");
  check_cpu(data, "data");
  TORCH_CHECK(is_float_type(out.scalar_type()),
              "out must be float32, float16 or bfloat16, got ", out.scalar_type());
  TORCH_CHECK(!two_d || out.dim() == 2, "out must be 2-d (N, D), got shape ", out.sizes());
  TORCH_CHECK(out.is_contiguous(), "out must be contiguous");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 1 && data.is_contiguous(),
              "data must be a contiguous 1-d uint8 tensor, got ", data.scalar_type(), " of shape ",
              data.sizes());
  check_group_size(group_size);
}

// lo and step: contiguous bf16 (rows, G) with rows `first` .. `first + n` present (`exact`:
// exactly n rows, the general entry's contract).
void check_metadata(const at::Tensor& lo, const at::Tensor& step, int64_t first, int64_t n,
                    int64_t g_per_row, bool exact) {
  for (const at::Tensor* t : {&lo, &step}) {
    const char* name = t == &lo ? "lo" : "step";
    check_cpu(*t, name);
    TORCH_CHECK(t->scalar_type() == at::kBFloat16, name, " must be bfloat16, got ",
                t->scalar_type());
    if (exact) {
      TORCH_CHECK(t->dim() == 2 && t->size(0) == n && t->size(1) == g_per_row, name,
                  " must have shape (", n, ", ", g_per_row, "), got ", t->sizes());
    } else {
      TORCH_CHECK_VALUE(t->dim() == 2 && t->size(1) == g_per_row && first >= 0 &&
                            first + n <= t->size(0),
                        "rows ", first, ":", first + n, " are not rows of ", name, " ",
                        t->sizes(), " with ", g_per_row, " groups per row");
    }
    TORCH_CHECK(t->is_contiguous(), name, " must be contiguous");
  }
}

at::Tensor dequantize_checked(const at::Tensor& data, const uint16_t* lo_p, const uint16_t* step_p,
                              const uint8_t* b, const int64_t* off, int64_t group_size,
                              at::Tensor& out, int64_t n_rows, int64_t d) {
  if (n_rows == 0 || d == 0) return out;
  advise_huge_pages(out.data_ptr(), out.numel() * static_cast<int64_t>(out.element_size()));
  const uint8_t* in = data.data_ptr<uint8_t>();
  switch (out.scalar_type()) {
    case at::kFloat:
      dequantize_impl(in, lo_p, step_p, b, off, n_rows, d, group_size, out.data_ptr<float>());
      break;
    case at::kHalf:
      dequantize_impl(in, lo_p, step_p, b, off, n_rows, d, group_size, out.data_ptr<c10::Half>());
      break;
    default:
      dequantize_impl(in, lo_p, step_p, b, off, n_rows, d, group_size,
                      out.data_ptr<c10::BFloat16>());
      break;
  }
  return out;
}

const uint16_t* bf16_bits(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

}  // namespace

at::Tensor dequantize_cpu(const at::Tensor& data, const at::Tensor& lo, const at::Tensor& step,
                          const at::Tensor& bits, const at::Tensor& offsets, int64_t group_size,
                          at::Tensor& out) {
  check_out_and_data(data, out, group_size, true);
  const int64_t n_rows = out.size(0), d = out.size(1);
  check_metadata(lo, step, 0, n_rows, (d + group_size - 1) / group_size, true);
  check_rows(bits, offsets, n_rows, d, data.numel(), "data", false);
  return dequantize_checked(data, bf16_bits(lo), bf16_bits(step), bits.data_ptr<uint8_t>(),
                            offsets.data_ptr<int64_t>(), group_size, out, n_rows, d);
}

at::Tensor dequantize_uniform_cpu(const at::Tensor& data, const at::Tensor& lo,
                                  const at::Tensor& step, int64_t bits, int64_t group_size,
                                  int64_t first, at::Tensor& out) {
  check_out_and_data(data, out, group_size, false);
  check_width(bits);
  const auto [n_rows, d] = contract_rows(out.sizes());
  const int64_t g_per_row = (d + group_size - 1) / group_size;
  check_metadata(lo, step, first, n_rows, g_per_row, false);
  TORCH_CHECK_VALUE(d <= (int64_t{1} << 59), "rows of ", d, " values are too long");
  const int64_t rb = row_bytes(d, static_cast<int>(bits));
  TORCH_CHECK_VALUE((first + n_rows) * rb <= data.numel(), "rows ", first, ":", first + n_rows,
                    " (", rb, " bytes each) do not fit in data (", data.numel(), " bytes)");
  const UniformRows rows(n_rows, d, bits, first);
  return dequantize_checked(data, bf16_bits(lo) + first * g_per_row,
                            bf16_bits(step) + first * g_per_row, rows.bits.data(),
                            rows.offsets.data(), group_size, out, n_rows, d);
}

namespace {
// Bytes of the mask per parallel task.
constexpr int64_t kMaskGrain = 1 << 14;
}  // namespace

at::Tensor pack_mask_cpu(const at::Tensor& mask) {
  check_cpu(mask, "mask");
  TORCH_CHECK(mask.scalar_type() == at::kBool, "mask must be bool, got ", mask.scalar_type());
  TORCH_CHECK(mask.is_contiguous(), "mask must be contiguous");
  const int64_t n = mask.numel();
  const int64_t nbytes = (n + 7) / 8;
  at::Tensor out = at::empty({nbytes}, mask.options().dtype(at::kByte));
  if (n == 0) return out;
  const uint8_t* m = reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>());
  uint8_t* o = out.data_ptr<uint8_t>();
  const int64_t full = n / 8;
  parallel_tasks(full, kMaskGrain, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t j = begin; j < end; ++j) {
      uint64_t v;
      std::memcpy(&v, m + 8 * j, 8);
      v &= 0x0101010101010101ull;  // bool bytes are 0/1; keep it so whatever they hold
      v |= v >> 7;
      v |= v >> 14;
      v |= v >> 28;
      o[j] = static_cast<uint8_t>(v);
    }
  });
  if (full < nbytes) {
    uint8_t byte = 0;
    for (int64_t i = 8 * full; i < n; ++i) byte |= static_cast<uint8_t>((m[i] != 0) << (i - 8 * full));
    o[full] = byte;
  }
  return out;
}

at::Tensor unpack_mask_cpu(const at::Tensor& packed, int64_t numel) {
  check_cpu(packed, "packed");
  TORCH_CHECK(packed.scalar_type() == at::kByte, "packed must be uint8, got ",
              packed.scalar_type());
  TORCH_CHECK(packed.is_contiguous(), "packed must be contiguous");
  TORCH_CHECK_VALUE(numel >= 0, "numel must be >= 0, got ", numel);
  TORCH_CHECK_VALUE(packed.numel() == (numel + 7) / 8, "packed mask of ", packed.numel(),
                    " bytes does not hold ", numel, " values (needs ", (numel + 7) / 8, ")");
  at::Tensor out = at::empty({numel}, packed.options().dtype(at::kBool));
  if (numel == 0) return out;
  const uint8_t* p = packed.data_ptr<uint8_t>();
  uint8_t* o = reinterpret_cast<uint8_t*>(out.data_ptr<bool>());
  const int64_t full = numel / 8;
  parallel_tasks(full, kMaskGrain, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t j = begin; j < end; ++j) {
      uint64_t v = p[j];
      v |= v << 28;
      v |= v << 14;
      v |= v << 7;
      v &= 0x0101010101010101ull;
      std::memcpy(o + 8 * j, &v, 8);
    }
  });
  for (int64_t i = 8 * full; i < numel; ++i) o[i] = (p[full] >> (i - 8 * full)) & 1;
  return out;
}


// ---------------------------------------------------------------------------------------------
// Fused backward of the 1-bit-mask layers: grad_in from grad_out and the packed bits, one pass
// ---------------------------------------------------------------------------------------------
// Per element, with m its bit: grad_in = m ? on(g) : off(g), where on(g) is g itself (kOnPass)
// or g * on, and off(g) is +0.0 (kOffZero) or g * off. Products are computed as torch computes
// `grad * scalar` and `grad * noise` (float32 opmath for float16/bfloat16, rounded back to
// nearest even; the scalar rounded to float32 first; float64 in float64), and a pass-through or
// zero moves bit patterns, as torch.where does, so the result equals the unfused
// `torch.where(mask, grad, 0)` / `torch.where(mask, grad, grad * a)` / `grad * noise` bit for bit.
namespace {

constexpr int kMaskUnit = 32;                  // elements per step: one uint32 of bits
constexpr int64_t kMaskGradGrain = int64_t{1} << 12;  // units per parallel task (128K values)

inline uint32_t unit_bits(const uint8_t* p, int64_t u) {
  uint32_t w;
  std::memcpy(&w, p + 4 * u, 4);
  return w;
}

// float32 / float64: everything in the element type. The products are computed for every lane
// in loops of their own and the choice is made on bit patterns: a select between two float
// products in one loop is not if-converted by gcc under -ftrapping-math (it would speculate a
// multiplication), and that loop then runs scalar, ~5x slower.
//
// The lanes are read and written in place through may_alias integer views: staging them in
// local arrays with memcpy (the strict-aliasing-safe spelling) made gcc store 16-byte halves and
// load them back as 32-byte vectors, a failed store forward per vector, and the kernel ran at
// about a quarter of threshold_backward's speed (scripts/bench_kernels.py --calls 3).
template <typename T> struct SameBits;
template <> struct SameBits<float> { typedef uint32_t __attribute__((may_alias)) type; };
template <> struct SameBits<double> { typedef uint64_t __attribute__((may_alias)) type; };

template <typename T, bool kOnPass, bool kOffZero>
AZ_INLINE void masked_unit_wide(const T* __restrict g, uint32_t w, int n, T on, T off,
                                T* __restrict out) {
  using U = typename SameBits<T>::type;
  alignas(64) T av[kMaskUnit];
  alignas(64) T bv[kMaskUnit];
  if (!kOnPass) {
#pragma omp simd
    for (int k = 0; k < n; ++k) av[k] = g[k] * on;
  }
  if (!kOffZero) {
#pragma omp simd
    for (int k = 0; k < n; ++k) bv[k] = g[k] * off;
  }
  const U* __restrict gb = reinterpret_cast<const U*>(g);
  const U* __restrict ab = reinterpret_cast<const U*>(av);
  const U* __restrict bb = reinterpret_cast<const U*>(bv);
  U* __restrict ob = reinterpret_cast<U*>(out);
#pragma omp simd
  for (int k = 0; k < n; ++k) {
    const U m = U{0} - static_cast<U>((w >> k) & 1u);  // all ones where the bit is set
    const U a = kOnPass ? gb[k] : ab[k];
    const U b = kOffZero ? U{0} : bb[k];
    ob[k] = (a & m) | (b & ~m);
  }
}

// float16 / bfloat16: products in float32, rounded back; pass-through and zero on bit patterns.
template <typename T, bool kOnPass, bool kOffZero>
AZ_INLINE void masked_unit_half(const T* __restrict g, uint32_t w, int n, float on, float off,
                                T* __restrict out) {
  alignas(64) float xf[kMaskUnit];
  alignas(64) float af[kMaskUnit];
  alignas(64) float bf[kMaskUnit];
  alignas(64) T at[kMaskUnit];
  alignas(64) T bt[kMaskUnit];
  const uint16_t* __restrict gb = reinterpret_cast<const uint16_t*>(g);
  uint16_t* __restrict ob = reinterpret_cast<uint16_t*>(out);
  if (!kOnPass || !kOffZero) load_block(g, n, xf);
  if (!kOnPass) {
#pragma omp simd
    for (int k = 0; k < n; ++k) af[k] = xf[k] * on;
    store_block(af, n, at);
  }
  if (!kOffZero) {
#pragma omp simd
    for (int k = 0; k < n; ++k) bf[k] = xf[k] * off;
    store_block(bf, n, bt);
  }
  const uint16_t* __restrict ab = reinterpret_cast<const uint16_t*>(at);
  const uint16_t* __restrict bb = reinterpret_cast<const uint16_t*>(bt);
#pragma omp simd
  for (int k = 0; k < n; ++k) {
    const bool m = ((w >> k) & 1u) != 0;
    const uint16_t a = kOnPass ? gb[k] : ab[k];
    const uint16_t b = kOffZero ? uint16_t{0} : bb[k];
    ob[k] = m ? a : b;
  }
}

template <typename T, bool kOnPass, bool kOffZero, typename S>
void masked_grad_impl(const T* g, const uint8_t* p, int64_t n, S on, S off, T* out) {
  auto unit = [&](int64_t e, uint32_t w, int len) {
    if constexpr (std::is_same<T, float>::value || std::is_same<T, double>::value) {
      masked_unit_wide<T, kOnPass, kOffZero>(g + e, w, len, on, off, out + e);
    } else {
      masked_unit_half<T, kOnPass, kOffZero>(g + e, w, len, on, off, out + e);
    }
  };
  const int64_t units = n / kMaskUnit;
  parallel_tasks(units, kMaskGradGrain, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) unit(u * kMaskUnit, unit_bits(p, u), kMaskUnit);
  });
  const int64_t e = units * kMaskUnit;
  if (e < n) {  // the last < 32 values: their bytes, zero-padded
    const int rest = static_cast<int>(n - e);
    uint32_t w = 0;
    std::memcpy(&w, p + e / 8, static_cast<size_t>((rest + 7) / 8));
    unit(e, w, rest);
  }
}

template <typename T, typename S>
void masked_grad_dispatch(const T* g, const uint8_t* p, int64_t n, bool on_pass, S on,
                          bool off_zero, S off, T* out) {
  if (on_pass && off_zero) {
    masked_grad_impl<T, true, true>(g, p, n, on, off, out);
  } else if (on_pass) {
    masked_grad_impl<T, true, false>(g, p, n, on, off, out);
  } else if (off_zero) {
    masked_grad_impl<T, false, true>(g, p, n, on, off, out);
  } else {
    masked_grad_impl<T, false, false>(g, p, n, on, off, out);
  }
}

}  // namespace

at::Tensor masked_grad_cpu(const at::Tensor& grad, const at::Tensor& packed,
                           std::optional<double> on, std::optional<double> off) {
  check_cpu(grad, "grad");
  check_cpu(packed, "packed");
  const at::ScalarType t = grad.scalar_type();
  TORCH_CHECK(is_float_type(t) || t == at::kDouble,
              "grad must be float32, float64, float16 or bfloat16, got ", t);
  TORCH_CHECK(grad.is_contiguous(), "grad must be contiguous");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 1 && packed.is_contiguous(),
              "packed must be a contiguous 1-d uint8 tensor, got ", packed.scalar_type(),
              " of shape ", packed.sizes());
  const int64_t n = grad.numel();
  TORCH_CHECK_VALUE(packed.numel() == (n + 7) / 8, "packed mask of ", packed.numel(),
                    " bytes does not hold ", n, " values (needs ", (n + 7) / 8, ")");
  at::Tensor out = at::empty_like(grad, at::MemoryFormat::Contiguous);
  if (n == 0) return out;
  advise_huge_pages(out.data_ptr(), n * static_cast<int64_t>(out.element_size()));
  const uint8_t* p = packed.data_ptr<uint8_t>();
  const bool on_pass = !on.has_value(), off_zero = !off.has_value();
  const double on_v = on.value_or(1.0), off_v = off.value_or(0.0);
  switch (t) {
    case at::kDouble:
      masked_grad_dispatch<double, double>(grad.data_ptr<double>(), p, n, on_pass, on_v,
                                           off_zero, off_v, out.data_ptr<double>());
      break;
    case at::kFloat:
      masked_grad_dispatch<float, float>(grad.data_ptr<float>(), p, n, on_pass,
                                         static_cast<float>(on_v), off_zero,
                                         static_cast<float>(off_v), out.data_ptr<float>());
      break;
    case at::kHalf:
      masked_grad_dispatch<c10::Half, float>(grad.data_ptr<c10::Half>(), p, n, on_pass,
                                             static_cast<float>(on_v), off_zero,
                                             static_cast<float>(off_v),
                                             out.data_ptr<c10::Half>());
      break;
    default:
      masked_grad_dispatch<c10::BFloat16, float>(grad.data_ptr<c10::BFloat16>(), p, n, on_pass,
                                                 static_cast<float>(on_v), off_zero,
                                                 static_cast<float>(off_v),
                                                 out.data_ptr<c10::BFloat16>());
      break;
  }
  return out;
}

}  // namespace actnn_zoo
