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
constexpr int kMaxDims = 16;

// Memory offset of a flat logical (row-major) index of a tensor of any strides.
struct Strided {
  int nd = 0;
  bool flat = true;  // contiguous: the offset is the index
  int64_t size[kMaxDims] = {};
  int64_t stride[kMaxDims] = {};

  explicit Strided(const at::Tensor& t) {
    TORCH_CHECK_VALUE(t.dim() <= kMaxDims, "tensors of at most ", kMaxDims, " dims, got ",
                      t.dim());
    flat = t.is_contiguous();
    nd = static_cast<int>(t.dim());
    for (int d = 0; d < nd; ++d) {
      size[d] = t.size(d);
      stride[d] = t.stride(d);
    }
  }
  AZ_INLINE int64_t at(int64_t i) const {
    if (flat) return i;
    int64_t off = 0;
    for (int d = nd - 1; d >= 0; --d) {
      const int64_t s = size[d];
      const int64_t q = i / s;
      off += (i - q * s) * stride[d];
      i = q;
    }
    return off;
  }
};

// (i / block) % period, period <= 0 meaning no wrap.
AZ_INLINE int64_t stat_index(int64_t i, int64_t block, int64_t period) {
  const int64_t s = i / block;
  return period > 0 ? s % period : s;
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

struct Payload {  // the metadata of the coded tensor the variances describe
  const uint16_t* lo;
  const uint16_t* step;
  const uint8_t* row_bits;  // null: one width
  float levels;             // 2^bits - 1 of the one width
  int64_t d, groups, group_size;
};

struct Source {  // where the values come from
  const void* x;
  Strided at;
  const void* shift;  // null: the values themselves; else (x - shift[s]) * scale[s]
  const void* scale;
  int64_t block, period;
};

// The value at flat index i: x_i as float32, or its normalized value computed in W (float32, or
// float64 for a float64 input) and rounded to float32, as the twin computes it.
template <typename T, typename W>
AZ_INLINE float value_at(const Source& s, int64_t i) {
  const T x = static_cast<const T*>(s.x)[s.at.at(i)];
  if (s.shift == nullptr) return as_float(x);
  const int64_t j = stat_index(i, s.block, s.period);
  const W m = static_cast<const W*>(s.shift)[j];
  const W c = static_cast<const W*>(s.scale)[j];
  W w;
  if constexpr (std::is_same<W, double>::value) {
    w = static_cast<double>(x);
  } else {
    w = as_float(x);
  }
  return static_cast<float>((w - m) * c);
}

// Slots [k0, k0 + n) of the variance vector (n <= kVarGroup) into v.
template <typename T, typename W>
void variance_slots(const Payload& p, const Source& s, int64_t numel, int64_t offset,
                    int64_t stride, int64_t k0, int n, float* v) {
  for (int e = 0; e < n; ++e) {
    const int64_t i = offset + (k0 + e) * stride;
    if (i >= numel) {
      v[e] = 0.0f;
      continue;
    }
    const int64_t row = i / p.d;
    const int64_t g = (i - row * p.d) / p.group_size;
    const float lo = bf16_value(p.lo[row * p.groups + g]);
    const float step = bf16_value(p.step[row * p.groups + g]);
    const float levels =
        p.row_bits != nullptr ? static_cast<float>((1 << p.row_bits[row]) - 1) : p.levels;
    v[e] = rounding_variance(value_at<T, W>(s, i), lo, step, levels);
  }
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
void variance_codes_impl(const Payload& p, const Source& s, int64_t numel, int64_t offset,
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
                        at::ScalarType dtype) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->device().is_cpu(), name, " must be a CPU tensor, got one on ", t->device());
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

at::Tensor rounding_variance_codes_cpu(
    const at::Tensor& lo, const at::Tensor& step, const std::optional<at::Tensor>& row_bits,
    int64_t bits, int64_t group_size, const at::Tensor& src,
    const std::optional<at::Tensor>& shift, const std::optional<at::Tensor>& scale,
    int64_t stat_block, int64_t stat_period, int64_t offset, int64_t stride, int64_t seed) {
  RECORD_USER_SCOPE("actnn_zoo::rounding_variance_codes");
  for (const at::Tensor* t : {&lo, &step, &src}) {
    TORCH_CHECK(t->device().is_cpu(), "rounding_variance_codes: CPU tensors only, got one on ",
                t->device());
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
    TORCH_CHECK(row_bits->device().is_cpu() && row_bits->scalar_type() == at::kByte &&
                    row_bits->dim() == 1 && row_bits->size(0) == n_rows &&
                    row_bits->is_contiguous(),
                "row_bits must be contiguous uint8 (", n_rows, ",), got ", row_bits->sizes(), " ",
                row_bits->scalar_type());
    rb = row_bits->data_ptr<uint8_t>();
    for (int64_t r = 0; r < n_rows; ++r) {
      TORCH_CHECK_VALUE(rb[r] == 1 || rb[r] == 2 || rb[r] == 4 || rb[r] == 8, "row_bits[", r,
                        "] must be 1, 2, 4 or 8, got ", static_cast<int>(rb[r]));
    }
  } else {
    TORCH_CHECK_VALUE(bits == 1 || bits == 2 || bits == 4 || bits == 8,
                      "bits must be 1, 2, 4 or 8, got ", bits);
    levels = static_cast<float>((1 << bits) - 1);
  }
  const bool wide = src.scalar_type() == at::kDouble;
  const at::ScalarType stat_dtype = wide ? at::kDouble : at::kFloat;
  check_float_vector(shift, "shift", stat_dtype);
  check_float_vector(scale, "scale", stat_dtype);
  check_stat_range(shift, "shift", numel, stat_block, stat_period);
  check_stat_range(scale, "scale", numel, stat_block, stat_period);

  const int64_t slots = (numel + stride - 1) / stride;
  const int64_t vgroups = (slots + kVarGroup - 1) / kVarGroup;
  at::Tensor buf = at::empty({4 * vgroups + (slots + 7) / 8}, src.options().dtype(at::kByte));
  if (slots == 0) return buf;

  const Payload p{reinterpret_cast<const uint16_t*>(lo.data_ptr<at::BFloat16>()),
                  reinterpret_cast<const uint16_t*>(step.data_ptr<at::BFloat16>()), rb, levels,
                  d, groups, group_size};
  const Source s{src.data_ptr(), Strided(src),
                 shift.has_value() ? shift->data_ptr() : nullptr,
                 scale.has_value() ? scale->data_ptr() : nullptr, stat_block, stat_period};
  const uint32_t key = seed_key(static_cast<uint32_t>(seed & 0xFFFFFFFF));
  uint8_t* base = buf.data_ptr<uint8_t>();  // the allocator's alignment: uint16 at even bytes
  uint16_t* lo_out = reinterpret_cast<uint16_t*>(base);
  uint16_t* step_out = lo_out + vgroups;
  uint8_t* out = base + 4 * vgroups;
  switch (src.scalar_type()) {
    case at::kFloat:
      variance_codes_impl<float, float>(p, s, numel, offset, stride, slots, key, out, lo_out,
                                        step_out);
      break;
    case at::kHalf:
      variance_codes_impl<c10::Half, float>(p, s, numel, offset, stride, slots, key, out, lo_out,
                                            step_out);
      break;
    case at::kBFloat16:
      variance_codes_impl<c10::BFloat16, float>(p, s, numel, offset, stride, slots, key, out,
                                                lo_out, step_out);
      break;
    case at::kDouble:
      variance_codes_impl<double, double>(p, s, numel, offset, stride, slots, key, out, lo_out,
                                          step_out);
      break;
    default:
      TORCH_CHECK(false, "src must be float32, float16, bfloat16 or float64, got ",
                  src.scalar_type());
  }
  return buf;
}

at::Tensor rounding_variance_correct_cpu(
    at::Tensor grad_in, const at::Tensor& grad, const at::Tensor& codes, int64_t offset,
    int64_t stride, const std::optional<at::Tensor>& scale,
    int64_t stat_block, int64_t stat_period, const std::optional<at::Tensor>& weight,
    int64_t weight_block, int64_t weight_period, double divisor) {
  RECORD_USER_SCOPE("actnn_zoo::rounding_variance_correct_");
  const at::Tensor& gin = grad_in;
  for (const at::Tensor* t : {&gin, &grad, &codes}) {
    TORCH_CHECK(t->device().is_cpu(), "rounding_variance_correct_: CPU tensors only, got one on ",
                t->device());
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
  check_float_vector(scale, "scale", at::kFloat);
  check_float_vector(weight, "weight", at::kFloat);
  check_stat_range(scale, "scale", numel, stat_block, stat_period);
  check_stat_range(weight, "weight", numel, weight_block, weight_period);
  const int64_t kept = offset < numel ? (numel - offset + stride - 1) / stride : 0;
  if (kept == 0) return grad_in;

  const Strided gi_at(grad_in), g_at(grad);
  float* gi = grad_in.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  const uint8_t* base = codes.data_ptr<uint8_t>();
  const uint16_t* vlo = reinterpret_cast<const uint16_t*>(base);
  const uint16_t* vstep = vlo + vgroups;
  const uint8_t* bits = base + 4 * vgroups;
  const float* sc = scale.has_value() ? scale->data_ptr<float>() : nullptr;
  const float* w = weight.has_value() ? weight->data_ptr<float>() : nullptr;
  const float div = static_cast<float>(divisor);
  const float fstride = static_cast<float>(stride);
  parallel_tasks(kept, 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t i = offset + k * stride;
      float c = sc != nullptr ? sc[stat_index(i, stat_block, stat_period)] : 1.0f;
      if (w != nullptr) c = c * w[stat_index(i, weight_block, weight_period)];
      c = c / div;
      const uint32_t code = (bits[k >> 3] >> (k & 7)) & 1u;
      const int64_t vg = k / kVarGroup;
      const float t = variance_correction(g[g_at.at(i)], c, code, bf16_value(vlo[vg]),
                                          bf16_value(vstep[vg]), fstride);
      float& out = gi[gi_at.at(i)];
      out = out + t;
    }
  });
  return grad_in;
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
  m.def("rounding_variance_codes", &rounding_variance_codes_cpu, nogil, py::arg("lo"),
        py::arg("step"), py::arg("row_bits"), py::arg("bits"), py::arg("group_size"),
        py::arg("src"), py::arg("shift"), py::arg("scale"), py::arg("stat_block"),
        py::arg("stat_period"), py::arg("offset"), py::arg("stride"), py::arg("seed"),
        "1-bit codes of the rounding variances of the values at flat indices offset + k * "
        "stride of a payload with metadata lo/step (N, G) and widths row_bits (N,) or bits; "
        "values src[i], or (src[i] - shift[s]) * scale[s] with s = (i / stat_block) % "
        "stat_period (_rounding_variance._sample_torch); one uint8 buffer [lo (G bf16) | step "
        "(G bf16) | packed bits]. CPU only.");
  m.def("rounding_variance_correct_", &rounding_variance_correct_cpu, nogil,
        py::arg("grad_in"), py::arg("grad"), py::arg("codes"), py::arg("offset"),
        py::arg("stride"), py::arg("scale"), py::arg("stat_block"), py::arg("stat_period"),
        py::arg("weight"), py::arg("weight_block"), py::arg("weight_period"),
        py::arg("divisor"),
        "grad_in[i] += (grad[i] * c_i) * (stride * v_hat_k) at i = offset + k * stride, in "
        "place, from rounding_variance_codes' buffer; c_i = scale[s] * weight[w] / divisor "
        "(_rounding_variance._correct_torch). float32, any strides. CPU only.");
}

}  // namespace actnn_zoo
