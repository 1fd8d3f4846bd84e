// The sampled rounding variances of softmax's and the norms' unbiased backward, on the CPU: one
// fused loop per direction (actnn_zoo/functional/_rounding_variance.py has the torch twin these
// must equal bit for bit, and says why the variances are saved).
//
// Forward (rounding_variance_codes): for the kept flat logical indices i = offset + k * stride
// of a payload of `numel` values, the value x_i (read from `src`, optionally normalized on the
// way: (src_i - shift[s]) * scale[s], s = (i / stat_block) % stat_period, as a norm's quantizer
// saw it), its group's lo / step / width from the payload's metadata, and
// step^2 f (1 - f) (variance.h); the slots past the last kept index are 0. The ceil(numel /
// stride) slots are then quantized at 1 bit exactly as quantize(var, 1, 256, seed) codes a
// 1-row tensor (group_meta, code_block and pack_block, the quantizer's own helpers), and that
// QuantizedTensor's three tensors are returned in one uint8 buffer, [lo (G bf16) | step (G bf16)
// | data (ceil(slots / 8) bytes)], G = ceil(slots / 256): a Function then saves one tensor more,
// not three (each saved tensor costs the autograd and capture hooks a few microseconds).
//
// Backward (rounding_variance_correct_): grad_in[i] += (g_i * c_i) * (v_hat_k * stride) at the
// kept indices, in place, with c_i = scale[s] * weight[w] / divisor (each factor optional),
// s = (i / stat_block) % stat_period, w = (i / weight_block) % weight_period.
//
// Both read and write through the tensors' strides (a gradient of sum() is an expanded scalar,
// an aten norm backward may return channels-last), so no contiguous copies are made. Host cost
// was the point: the twin's ~20 small torch ops cost ~300 us per call at tiny sizes.
#include "kernels.h"
#include "codes_cpu.h"
#include "decode_cpu.h"
#include "tasks_cpu.h"
#include "variance.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/record_function.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <optional>
#include <tuple>
#include <type_traits>

namespace actnn_zoo {
namespace {

constexpr int kVarGroup = 256;  // the 1-bit codes' group (_rounding_variance._VARIANCE_GROUP)

Strided strided_of(const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.dim() <= kVarMaxDims, "tensors of at most ", kVarMaxDims, " dims, got ",
                    t.dim());
  Strided s;
  s.flat = t.is_contiguous();
  s.nd = static_cast<int>(t.dim());
  for (int d = 0; d < s.nd; ++d) {
    s.size[d] = t.size(d);
    s.stride[d] = t.stride(d);
  }
  return s;
}

template <typename T>
AZ_INLINE float as_float(T v) {
  if constexpr (std::is_same<T, c10::Half>::value) {
    return half_value(reinterpret_cast<const uint16_t&>(v));
  } else if constexpr (std::is_same<T, c10::BFloat16>::value) {
    return bf16_value(reinterpret_cast<const uint16_t&>(v));
  } else {
    return static_cast<float>(v);
  }
}

// stat_index(i, block, period) (and i % block) along i, i + step, i + 2 step, ...: one
// division at the start and none per step. The loops below visit every stride-th value, and the
// int64 divisions of computing each index afresh (row, group, statistic: three to five a value)
// cost more than the value's arithmetic. Exact integer steps: the same indices as stat_index.
struct StatWalk {
  int64_t s = 0, r = 0;  // the index, and i % block
  int64_t block = 1, dr = 0, ds = 0, period = 0;

  StatWalk() = default;
  StatWalk(int64_t i, int64_t block_, int64_t period_, int64_t step)
      : block(block_), period(period_) {
    const int64_t q = i / block, dq = step / block;
    r = i - q * block;
    dr = step - dq * block;
    s = period > 0 ? q % period : q;
    ds = period > 0 ? dq % period : dq;
  }
  // r + dr < 2 block and s + ds + 1 < 2 period: one subtraction each at most, made without a
  // branch (a carry every few values would be a mispredicted jump as often).
  void next() {
    r += dr;
    const int64_t carry = static_cast<int64_t>(r >= block);
    r -= carry * block;
    s += ds + carry;
    if (period > 0) s -= static_cast<int64_t>(s >= period) * period;
  }
};

// log2(n) for a power of two (the usual group sizes: a shift, not a division), else -1.
int pow2_shift(int64_t n) {
  return n > 0 && (n & (n - 1)) == 0 ? __builtin_ctzll(static_cast<uint64_t>(n)) : -1;
}

// Slots [k0, k0 + n) of the variance vector (n <= kVarGroup) into v: for each kept i, the value
// (its statistic from a walk when normalized) and payload_variance (row and group from a walk).
template <typename T, typename W>
void variance_slots(const VarPayload& p, const VarSource& s, int64_t numel, int64_t offset,
                    int64_t stride, int64_t k0, int n, float* v) {
  int64_t i = offset + k0 * stride;
  const bool normalized = s.shift != nullptr;
  StatWalk rows(i, p.d, 0, stride);  // d > 0: check_codes splits numel > 0 into rows
  StatWalk stat = normalized ? StatWalk(i, s.block, s.period, stride) : StatWalk();
  const int gshift = pow2_shift(p.group_size);
  int e = 0;
  for (; e < n && i < numel; ++e, i += stride) {
    const T x = static_cast<const T*>(s.x)[s.at.at(i)];
    float value;
    if (!normalized) {
      value = as_float(x);
    } else if constexpr (std::is_same<W, double>::value) {
      value = normalized_value_at<double>(static_cast<double>(x), s, stat.s);
    } else {
      value = normalized_value_at<float>(as_float(x), s, stat.s);
    }
    const int64_t g = gshift >= 0 ? rows.r >> gshift : rows.r / p.group_size;
    v[e] = payload_variance_at(p, rows.s, g, value);
    rows.next();
    if (normalized) stat.next();
  }
  for (; e < n; ++e) v[e] = 0.0f;  // past the last kept index
}

// One 1-bit group of the variance vector: what quantize_group<float, 1, true> writes for it.
void code_variances(const float* v, int n, uint64_t i0, uint32_t key, uint8_t* out, uint16_t* lo,
                    uint16_t* step) {
  float mn = INFINITY, mx = -INFINITY, bad = 0.0f;
  for (int k = 0; k < n; ++k) {
    mn = v[k] < mn ? v[k] : mn;
    mx = v[k] > mx ? v[k] : mx;
    bad = bad + v[k] * 0.0f;
  }
  const GroupMeta meta = group_meta(mn, mx, bad == 0.0f, 1.0f);
  *lo = meta.lo;
  *step = meta.step;
  const int nbytes = (n + 7) / 8;
  if (meta.bad) {
    std::memset(out, 0, static_cast<size_t>(nbytes));
    return;
  }
  alignas(64) int32_t codes32[kVarGroup];
  alignas(64) uint8_t codes[kVarGroup + 8];
  const float lo_f = bf16_value(meta.lo);
  const float step_f = bf16_value(meta.step);
  const float inv = step_f > 0.0f ? 1.0f / step_f : 0.0f;
  code_block<true>(v, n, lo_f, inv, 1.0f, i0, key, codes32);
  for (int k = 0; k < n; ++k) codes[k] = static_cast<uint8_t>(codes32[k]);
  std::memset(codes + n, 0, 8);
  pack_block<1>(codes, nbytes, out);
}

template <typename T, typename W>
void variance_codes_impl(const VarPayload& p, const VarSource& s, int64_t numel, int64_t offset,
                         int64_t stride, int64_t slots, uint32_t key, uint8_t* data,
                         uint16_t* lo, uint16_t* step) {
  const int64_t groups = (slots + kVarGroup - 1) / kVarGroup;
  parallel_tasks(groups, 64, [&](int64_t begin, int64_t end) {
    alignas(64) float v[kVarGroup];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t k0 = g * kVarGroup;
      const int n = static_cast<int>(std::min<int64_t>(kVarGroup, slots - k0));
      variance_slots<T, W>(p, s, numel, offset, stride, k0, n, v);
      code_variances(v, n, static_cast<uint64_t>(k0), key, data + k0 / 8, lo + g, step + g);
    }
  });
}

void check_float_vector(const std::optional<at::Tensor>& t, const char* name,
                        at::ScalarType dtype, c10::Device dev) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->device() == dev, name, " must be on ", dev, ", got one on ", t->device());
  TORCH_CHECK(t->scalar_type() == dtype, name, " must be ", dtype, ", got ", t->scalar_type());
  TORCH_CHECK(t->is_contiguous(), name, " must be contiguous");
}

void check_stat_range(const std::optional<at::Tensor>& t, const char* name, int64_t numel,
                      int64_t block, int64_t period) {
  if (!t.has_value() || numel == 0) return;
  TORCH_CHECK_VALUE(block > 0, name, ": block must be positive, got ", block);
  const int64_t need = period > 0 ? std::min(period, (numel - 1) / block + 1)
                                  : (numel - 1) / block + 1;
  TORCH_CHECK_VALUE(t->numel() >= need, name, " has ", t->numel(), " values but index ",
                    need - 1, " is read");
}

}  // namespace

// (offset, seed) of one call, from torch's default CPU generator (reproducible under
// torch.manual_seed) without a tensor: the offset exactly uniform in [0, stride) (32-bit draws,
// rejection past the last multiple of stride), the seed 31 bits like quant.draw_seed. Why not
// torch.randint(...).item(): each such read is a _local_scalar_dense per call (~5 us).
std::tuple<int64_t, int64_t> draw_sample_cpu(int64_t stride) {
  TORCH_CHECK_VALUE(stride >= 1 && stride <= (int64_t{1} << 31),
                    "stride must be in [1, 2^31], got ", stride);
  auto gen = at::globalContext().defaultGenerator(c10::DeviceType::CPU);
  std::lock_guard<std::mutex> lock(gen.mutex());
  at::CPUGeneratorImpl* g = at::check_generator<at::CPUGeneratorImpl>(gen);
  const uint64_t s = static_cast<uint64_t>(stride);
  const uint64_t limit = (uint64_t{1} << 32) - (uint64_t{1} << 32) % s;
  uint64_t r;
  do {
    r = g->random();
  } while (r >= limit);
  const int64_t seed = static_cast<int64_t>(g->random() & 0x7FFFFFFFu);
  return {static_cast<int64_t>(r % s), seed};
}

// quant/seeds.py's read of torch's generator, without a tensor: torch.randint(0, 2^31 - 1, (1,))
// on the CPU draws with uniform_int_from_to_distribution, which for a range of 2^28 or more
// (ATen/core/DistributionsHelper.h, non-fbcode builds) takes one 64-bit draw modulo the range.
// This returns the value that call would and leaves the generator where it would
// (tests/test_seeds.py compares both over many seeds), at ~0.5 us instead of a tensor op and a
// read.
int64_t draw_seed_cpu() {
  constexpr uint64_t kRange = 2147483647u;  // 2^31 - 1
  auto gen = at::globalContext().defaultGenerator(c10::DeviceType::CPU);
  std::lock_guard<std::mutex> lock(gen.mutex());
  at::CPUGeneratorImpl* g = at::check_generator<at::CPUGeneratorImpl>(gen);
  return static_cast<int64_t>(g->random64() % kRange);
}

// quant/seeds.py's SeedStream.next: the k-th seed of a stream keyed by `key`, fmix32(key ^
// fmix32(k)) on the low 32 bits, top bit dropped (two Python-int fmix32 calls cost ~1.5 us; a
// converted ResNet-50 draws ~150 seeds a step).
int64_t stream_seed(int64_t key, int64_t k) {
  return static_cast<int64_t>(
      fmix32(static_cast<uint32_t>(key) ^ fmix32(static_cast<uint32_t>(k))) & 0x7FFFFFFFu);
}

namespace {

// The checked arguments of rounding_variance_codes, on the device of src (CPU or CUDA): every
// check runs here, in host-compiled code, before any kernel is called (quant_cuda.cu says why
// the .cu files print no sizes).
struct CodesCall {
  VarPayload p;
  VarSource s;
  int64_t numel, slots, vgroups;
};

CodesCall check_codes(const at::Tensor& lo, const at::Tensor& step,
                      const std::optional<at::Tensor>& row_bits, int64_t bits, int64_t group_size,
                      const at::Tensor& src, const std::optional<at::Tensor>& shift,
                      const std::optional<at::Tensor>& scale, int64_t stat_block,
                      int64_t stat_period, int64_t offset, int64_t stride) {
  const c10::Device dev = src.device();
  TORCH_CHECK(dev.is_cpu() || dev.is_cuda(),
              "rounding_variance_codes: CPU or CUDA tensors only, got src on ", dev);
  for (const at::Tensor* t : {&lo, &step}) {
    TORCH_CHECK(t->device() == dev, "rounding_variance_codes: lo, step and src must be on one "
                "device, got ", t->device(), " and ", dev);
  }
  TORCH_CHECK(lo.scalar_type() == at::kBFloat16 && step.scalar_type() == at::kBFloat16 &&
                  lo.dim() == 2 && lo.sizes() == step.sizes() && lo.is_contiguous() &&
                  step.is_contiguous(),
              "lo and step must be contiguous bfloat16 (N, G) of one shape, got ", lo.sizes(),
              " ", lo.scalar_type(), " and ", step.sizes(), " ", step.scalar_type());
  check_group_size(group_size);
  TORCH_CHECK_VALUE(stride >= 1, "stride must be >= 1, got ", stride);
  TORCH_CHECK_VALUE(offset >= 0 && offset < stride, "offset must be in [0, stride), got ", offset);
  TORCH_CHECK_VALUE(shift.has_value() == scale.has_value(),
                    "shift and scale must be given together");
  const int64_t numel = src.numel();
  const int64_t n_rows = lo.size(0), groups = lo.size(1);
  TORCH_CHECK_VALUE(numel == 0 || (n_rows > 0 && numel % n_rows == 0), numel,
                    " values do not split into ", n_rows, " rows");
  const int64_t d = n_rows > 0 ? numel / n_rows : 0;
  TORCH_CHECK_VALUE(groups == (d + group_size - 1) / group_size, "lo/step have ", groups,
                    " groups per row, rows of ", d, " values need ",
                    (d + group_size - 1) / group_size);
  const uint8_t* rb = nullptr;
  float levels = 0.0f;
  if (row_bits.has_value()) {
    TORCH_CHECK(row_bits->device() == dev && row_bits->scalar_type() == at::kByte &&
                    row_bits->dim() == 1 && row_bits->size(0) == n_rows &&
                    row_bits->is_contiguous(),
                "row_bits must be contiguous uint8 (", n_rows, ",) on ", dev, ", got ",
                row_bits->sizes(), " ", row_bits->scalar_type(), " on ", row_bits->device());
    rb = row_bits->data_ptr<uint8_t>();
    if (dev.is_cpu()) {  // on a GPU the values stay there (no read-back): other widths give 0
      for (int64_t r = 0; r < n_rows; ++r) {
        TORCH_CHECK_VALUE(rb[r] == 1 || rb[r] == 2 || rb[r] == 4 || rb[r] == 8, "row_bits[", r,
                          "] must be 1, 2, 4 or 8, got ", static_cast<int>(rb[r]));
      }
    }
  } else {
    TORCH_CHECK_VALUE(bits == 1 || bits == 2 || bits == 4 || bits == 8,
                      "bits must be 1, 2, 4 or 8, got ", bits);
    levels = static_cast<float>((1 << bits) - 1);
  }
  TORCH_CHECK(src.scalar_type() == at::kFloat || src.scalar_type() == at::kHalf ||
                  src.scalar_type() == at::kBFloat16 || src.scalar_type() == at::kDouble,
              "src must be float32, float16, bfloat16 or float64, got ", src.scalar_type());
  const at::ScalarType stat_dtype = src.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  check_float_vector(shift, "shift", stat_dtype, dev);
  check_float_vector(scale, "scale", stat_dtype, dev);
  check_stat_range(shift, "shift", numel, stat_block, stat_period);
  check_stat_range(scale, "scale", numel, stat_block, stat_period);
  const int64_t slots = (numel + stride - 1) / stride;
  CodesCall c;
  c.p = VarPayload{reinterpret_cast<const uint16_t*>(lo.data_ptr<at::BFloat16>()),
                   reinterpret_cast<const uint16_t*>(step.data_ptr<at::BFloat16>()), rb, levels,
                   d, groups, group_size};
  c.s = VarSource{src.data_ptr(), strided_of(src),
                  shift.has_value() ? shift->data_ptr() : nullptr,
                  scale.has_value() ? scale->data_ptr() : nullptr, stat_block, stat_period};
  c.numel = numel;
  c.slots = slots;
  c.vgroups = (slots + kVarGroup - 1) / kVarGroup;
  return c;
}

// The checked arguments of rounding_variance_correct_, on the device of grad_in.
struct CorrectCall {
  VarCorrection c;
  Strided gi_at, g_at;
  int64_t kept;
};

CorrectCall check_correct(const at::Tensor& grad_in, const at::Tensor& grad,
                          const at::Tensor& codes, int64_t offset, int64_t stride,
                          const std::optional<at::Tensor>& scale, int64_t stat_block,
                          int64_t stat_period, const std::optional<at::Tensor>& weight,
                          int64_t weight_block, int64_t weight_period, double divisor) {
  const c10::Device dev = grad_in.device();
  TORCH_CHECK(dev.is_cpu() || dev.is_cuda(),
              "rounding_variance_correct_: CPU or CUDA tensors only, got grad_in on ", dev);
  for (const at::Tensor* t : {&grad, &codes}) {
    TORCH_CHECK(t->device() == dev, "rounding_variance_correct_: grad_in, grad and codes must "
                "be on one device, got ", t->device(), " and ", dev);
  }
  TORCH_CHECK(grad_in.scalar_type() == at::kFloat && grad.scalar_type() == at::kFloat,
              "grad_in and grad must be float32, got ", grad_in.scalar_type(), " and ",
              grad.scalar_type());
  TORCH_CHECK_VALUE(at::has_internal_overlap(grad_in) != at::MemOverlap::Yes,
                    "grad_in must not overlap itself (it is written in place)");
  TORCH_CHECK_VALUE(grad_in.sizes() == grad.sizes(), "grad_in ", grad_in.sizes(),
                    " and grad ", grad.sizes(), " must have one shape");
  TORCH_CHECK_VALUE(stride >= 1, "stride must be >= 1, got ", stride);
  TORCH_CHECK_VALUE(offset >= 0 && offset < stride, "offset must be in [0, stride), got ", offset);
  const int64_t numel = grad_in.numel();
  const int64_t slots = (numel + stride - 1) / stride;
  const int64_t vgroups = (slots + kVarGroup - 1) / kVarGroup;
  const int64_t nbytes = 4 * vgroups + (slots + 7) / 8;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 1 && codes.is_contiguous() &&
                  codes.numel() == nbytes,
              "codes must be ", nbytes, " contiguous uint8 bytes (the 1-bit codes of ", slots,
              " values as rounding_variance_codes packs them), got ", codes.numel(), " ",
              codes.scalar_type());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(codes.data_ptr()) % 2 == 0,
              "codes must start at an even address (bf16 metadata first)");
  check_float_vector(scale, "scale", at::kFloat, dev);
  check_float_vector(weight, "weight", at::kFloat, dev);
  check_stat_range(scale, "scale", numel, stat_block, stat_period);
  check_stat_range(weight, "weight", numel, weight_block, weight_period);
  const uint8_t* base = codes.data_ptr<uint8_t>();
  CorrectCall c;
  c.c = VarCorrection{reinterpret_cast<const uint16_t*>(base),
                      reinterpret_cast<const uint16_t*>(base) + vgroups, base + 4 * vgroups,
                      scale.has_value() ? scale->data_ptr<float>() : nullptr,
                      weight.has_value() ? weight->data_ptr<float>() : nullptr, stat_block,
                      stat_period, weight_block, weight_period, kVarGroup,
                      static_cast<float>(divisor), static_cast<float>(stride)};
  c.gi_at = strided_of(grad_in);
  c.g_at = strided_of(grad);
  c.kept = offset < numel ? (numel - offset + stride - 1) / stride : 0;
  return c;
}

}  // namespace

at::Tensor rounding_variance_codes_cpu(
    const at::Tensor& lo, const at::Tensor& step, const std::optional<at::Tensor>& row_bits,
    int64_t bits, int64_t group_size, const at::Tensor& src,
    const std::optional<at::Tensor>& shift, const std::optional<at::Tensor>& scale,
    int64_t stat_block, int64_t stat_period, int64_t offset, int64_t stride, int64_t seed) {
  RECORD_USER_SCOPE("actnn_zoo::rounding_variance_codes");
  TORCH_CHECK(src.device().is_cpu(), "rounding_variance_codes_cpu: CPU tensors only, got one on ",
              src.device());
  const CodesCall c = check_codes(lo, step, row_bits, bits, group_size, src, shift, scale,
                                  stat_block, stat_period, offset, stride);
  at::Tensor buf =
      at::empty({4 * c.vgroups + (c.slots + 7) / 8}, src.options().dtype(at::kByte));
  if (c.slots == 0) return buf;
  const uint32_t key = seed_key(static_cast<uint32_t>(seed & 0xFFFFFFFF));
  uint8_t* base = buf.data_ptr<uint8_t>();  // the allocator's alignment: uint16 at even bytes
  uint16_t* lo_out = reinterpret_cast<uint16_t*>(base);
  uint16_t* step_out = lo_out + c.vgroups;
  uint8_t* out = base + 4 * c.vgroups;
  switch (src.scalar_type()) {
    case at::kFloat:
      variance_codes_impl<float, float>(c.p, c.s, c.numel, offset, stride, c.slots, key, out,
                                        lo_out, step_out);
      break;
    case at::kHalf:
      variance_codes_impl<c10::Half, float>(c.p, c.s, c.numel, offset, stride, c.slots, key,
                                            out, lo_out, step_out);
      break;
    case at::kBFloat16:
      variance_codes_impl<c10::BFloat16, float>(c.p, c.s, c.numel, offset, stride, c.slots, key,
                                                out, lo_out, step_out);
      break;
    default:  // float64 (check_codes admits nothing else)
      variance_codes_impl<double, double>(c.p, c.s, c.numel, offset, stride, c.slots, key, out,
                                          lo_out, step_out);
  }
  return buf;
}

at::Tensor rounding_variance_correct_cpu(
    at::Tensor grad_in, const at::Tensor& grad, const at::Tensor& codes, int64_t offset,
    int64_t stride, const std::optional<at::Tensor>& scale,
    int64_t stat_block, int64_t stat_period, const std::optional<at::Tensor>& weight,
    int64_t weight_block, int64_t weight_period, double divisor) {
  RECORD_USER_SCOPE("actnn_zoo::rounding_variance_correct_");
  TORCH_CHECK(grad_in.device().is_cpu(),
              "rounding_variance_correct_cpu: CPU tensors only, got one on ", grad_in.device());
  const CorrectCall c = check_correct(grad_in, grad, codes, offset, stride, scale, stat_block,
                                      stat_period, weight, weight_block, weight_period, divisor);
  if (c.kept == 0) return grad_in;
  float* gi = grad_in.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  const VarCorrection& v = c.c;  // v.group is kVarGroup (check_correct)
  parallel_tasks(c.kept, 1 << 14, [&](int64_t begin, int64_t end) {
    // correction_term's statistic and weight indices, walked (StatWalk)
    int64_t i = offset + begin * stride;
    StatWalk s_at = v.scale != nullptr ? StatWalk(i, v.stat_block, v.stat_period, stride)
                                       : StatWalk();
    StatWalk w_at = v.weight != nullptr ? StatWalk(i, v.weight_block, v.weight_period, stride)
                                        : StatWalk();
    for (int64_t k = begin; k < end; ++k, i += stride) {
      float& out = gi[c.gi_at.at(i)];
      out = out + correction_term_at(v, k, s_at.s, w_at.s, k / kVarGroup, g[c.g_at.at(i)]);
      if (v.scale != nullptr) s_at.next();
      if (v.weight != nullptr) w_at.next();
    }
  });
  return grad_in;
}

// The Python entries: the same checks, then the CPU loops or the CUDA kernels
// (variance_cuda.cu) by the tensors' device.
at::Tensor rounding_variance_codes(
    const at::Tensor& lo, const at::Tensor& step, const std::optional<at::Tensor>& row_bits,
    int64_t bits, int64_t group_size, const at::Tensor& src,
    const std::optional<at::Tensor>& shift, const std::optional<at::Tensor>& scale,
    int64_t stat_block, int64_t stat_period, int64_t offset, int64_t stride, int64_t seed) {
  if (!src.is_cuda()) {
    return rounding_variance_codes_cpu(lo, step, row_bits, bits, group_size, src, shift, scale,
                                       stat_block, stat_period, offset, stride, seed);
  }
#ifdef ACTNN_ZOO_CUDA
  RECORD_USER_SCOPE("actnn_zoo::rounding_variance_codes");
  const CodesCall c = check_codes(lo, step, row_bits, bits, group_size, src, shift, scale,
                                  stat_block, stat_period, offset, stride);
  return rounding_variance_codes_cuda(c.p, c.s, src, c.numel, offset, stride, c.slots, seed);
#else
  TORCH_CHECK(false, "rounding_variance_codes: this build of actnn_zoo has no CUDA kernels");
#endif
}

at::Tensor rounding_variance_correct_(
    at::Tensor grad_in, const at::Tensor& grad, const at::Tensor& codes, int64_t offset,
    int64_t stride, const std::optional<at::Tensor>& scale,
    int64_t stat_block, int64_t stat_period, const std::optional<at::Tensor>& weight,
    int64_t weight_block, int64_t weight_period, double divisor) {
  if (!grad_in.is_cuda()) {
    return rounding_variance_correct_cpu(grad_in, grad, codes, offset, stride, scale, stat_block,
                                         stat_period, weight, weight_block, weight_period,
                                         divisor);
  }
#ifdef ACTNN_ZOO_CUDA
  RECORD_USER_SCOPE("actnn_zoo::rounding_variance_correct_");
  const CorrectCall c = check_correct(grad_in, grad, codes, offset, stride, scale, stat_block,
                                      stat_period, weight, weight_block, weight_period, divisor);
  if (c.kept > 0) {
    rounding_variance_correct_cuda(grad_in, grad, c.c, c.gi_at, c.g_at, offset, stride, c.kept);
  }
  return grad_in;
#else
  TORCH_CHECK(false, "rounding_variance_correct_: this build of actnn_zoo has no CUDA kernels");
#endif
}

void register_variance(pybind11::module_& m) {
  namespace py = pybind11;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("draw_sample", &draw_sample_cpu, nogil, py::arg("stride"),
        "(offset uniform in [0, stride), 31-bit seed) from torch's default CPU generator "
        "(reproducible under torch.manual_seed), read without a tensor.");
  m.def("draw_seed", &draw_seed_cpu, nogil,
        "int(torch.randint(0, 2**31 - 1, (1,)).item()) on torch's default CPU generator, the "
        "same value and generator state, read without a tensor.");
  m.def("stream_seed", &stream_seed, py::arg("key"), py::arg("k"),
        "fmix32(key ^ fmix32(k)) & 0x7FFFFFFF on the low 32 bits of key and k: the k-th seed "
        "of quant.seeds.SeedStream.");
  m.def("rounding_variance_codes", &rounding_variance_codes, nogil, py::arg("lo"),
        py::arg("step"), py::arg("row_bits"), py::arg("bits"), py::arg("group_size"),
        py::arg("src"), py::arg("shift"), py::arg("scale"), py::arg("stat_block"),
        py::arg("stat_period"), py::arg("offset"), py::arg("stride"), py::arg("seed"),
        "1-bit codes of the rounding variances of the values at flat indices offset + k * "
        "stride of a payload with metadata lo/step (N, G) and widths row_bits (N,) or bits; "
        "values src[i], or (src[i] - shift[s]) * scale[s] with s = (i / stat_block) % "
        "stat_period (_rounding_variance._sample_torch); one uint8 buffer [lo (G bf16) | step "
        "(G bf16) | packed bits]. CPU and CUDA (whose row_bits values are not read back: a width "
        "outside {1, 2, 4, 8} gives 0 there, an error on the CPU).");
  m.def("rounding_variance_correct_", &rounding_variance_correct_, nogil,
        py::arg("grad_in"), py::arg("grad"), py::arg("codes"), py::arg("offset"),
        py::arg("stride"), py::arg("scale"), py::arg("stat_block"), py::arg("stat_period"),
        py::arg("weight"), py::arg("weight_block"), py::arg("weight_period"),
        py::arg("divisor"),
        "grad_in[i] += (grad[i] * c_i) * (stride * v_hat_k) at i = offset + k * stride, in "
        "place, from rounding_variance_codes' buffer; c_i = scale[s] * weight[w] / divisor "
        "(_rounding_variance._correct_torch). float32, any strides. CPU and CUDA.");
}

}  // namespace actnn_zoo
