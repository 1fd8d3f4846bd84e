// pack_compare: the 1-bit mask of a piecewise-linear activation, packed straight from its input.
//
// The unfused forward of QReLU & co. built the mask in three passes: a comparison into a bool
// tensor (`x <= 0`), its negation (another bool tensor) and pack_mask. Here each output byte is
// made from 8 inputs in one read of x, with no bool tensor: the same bits as
// `pack_mask(predicate(x))` (actnn_zoo/quant/reference.py, pack_compare), element i at bit i % 8
// of byte i / 8.
//
// Predicates, v an element (float16/bfloat16 widened exactly to float32; float64 as is), lo/hi
// values the caller made exactly representable in x's dtype, so comparing in the wider type
// answers as comparing in x's dtype does:
//   kind 0 "not_le":  !(v <= lo)          ReLU's threshold_backward (NaN -> 1)
//   kind 1 "gt":      v > lo              LeakyReLU's backward (NaN -> 0)
//   kind 2 "between": v > lo && v < hi    Hardtanh / ReLU6 (NaN -> 0)
#include "kernels.h"
#include "codes_cpu.h"
#include "isa_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace actnn_zoo {

#ifdef ACTNN_ZOO_CUDA
at::Tensor pack_compare_cuda(const at::Tensor& x, int64_t kind, double lo, double hi);
#endif

namespace {

constexpr int64_t kBytesPerTask = int64_t{1} << 13;  // 64K values per parallel task

template <int kKind, typename C>
inline bool predicate(C v, C lo, C hi) {
  if constexpr (kKind == 0) {
    return !(v <= lo);
  } else if constexpr (kKind == 1) {
    return v > lo;
  } else {
    return (v > lo) & (v < hi);
  }
}

// Blocks of 64 values: the predicate into 64 bytes of 0/1 (a loop gcc vectorises), then 8 bytes
// of 0/1 gathered into one output byte each by shifts (pack_mask's trick), all in L1.
constexpr int kPackBlock = 64;


template <int kKind, typename T, typename C>
void pack_compare_impl(const T* x, int64_t n, C lo, C hi, uint8_t* out) {
  const int64_t blocks = n / kPackBlock;
  at::parallel_for(0, blocks, kBytesPerTask / (kPackBlock / 8), [&](int64_t begin, int64_t end) {
    run_fast([&] {
      alignas(64) uint8_t m[kPackBlock];
      for (int64_t blk = begin; blk < end; ++blk) {
        const T* v = x + blk * kPackBlock;
#pragma omp simd
        for (int k = 0; k < kPackBlock; ++k) {
          m[k] = static_cast<uint8_t>(predicate<kKind, C>(static_cast<C>(v[k]), lo, hi));
        }
        for (int j = 0; j < kPackBlock / 8; ++j) {
          out[blk * (kPackBlock / 8) + j] = gather8(m + 8 * j);
        }
      }
    });
  });
  for (int64_t i = blocks * kPackBlock; i < n; i += 8) {  // the tail, byte by byte
    uint32_t byte = 0;
    for (int64_t k = i; k < std::min<int64_t>(n, i + 8); ++k) {
      byte |= static_cast<uint32_t>(predicate<kKind, C>(static_cast<C>(x[k]), lo, hi)) << (k - i);
    }
    out[i / 8] = static_cast<uint8_t>(byte);
  }
}

template <typename T, typename C>
void pack_compare_kind(const T* x, int64_t n, int64_t kind, C lo, C hi, uint8_t* out) {
  switch (kind) {
    case 0: pack_compare_impl<0>(x, n, lo, hi, out); break;
    case 1: pack_compare_impl<1>(x, n, lo, hi, out); break;
    default: pack_compare_impl<2>(x, n, lo, hi, out); break;
  }
}

at::Tensor pack_compare_cpu(const at::Tensor& x, int64_t kind, double lo, double hi,
                            const std::optional<at::Tensor>& into = std::nullopt) {
  TORCH_CHECK(x.device().is_cpu(), "x must be a CPU tensor, got ", x.device());
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  const at::ScalarType t = x.scalar_type();
  const int64_t n = x.numel();
  at::Tensor out;
  if (into.has_value()) {  // written through its pointer: its version counter does not move
    check_byte_buffer(*into, (n + 7) / 8, "pack_compare: out");
    out = *into;
  } else {
    out = at::empty({(n + 7) / 8}, x.options().dtype(at::kByte));
  }
  if (n == 0) return out;
  uint8_t* o = out.data_ptr<uint8_t>();
  const float lo32 = static_cast<float>(lo), hi32 = static_cast<float>(hi);
  switch (t) {
    case at::kDouble: pack_compare_kind(x.data_ptr<double>(), n, kind, lo, hi, o); break;
    case at::kFloat: pack_compare_kind(x.data_ptr<float>(), n, kind, lo32, hi32, o); break;
    case at::kHalf: pack_compare_kind(x.data_ptr<c10::Half>(), n, kind, lo32, hi32, o); break;
    default: pack_compare_kind(x.data_ptr<c10::BFloat16>(), n, kind, lo32, hi32, o); break;
  }
  return out;
}

at::Tensor pack_compare(const at::Tensor& x, int64_t kind, double lo, double hi,
                        const std::optional<at::Tensor>& out) {
  RECORD_USER_SCOPE("actnn_zoo::pack_compare");
  const at::ScalarType t = x.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16,
              "pack_compare: x must be float32, float64, float16 or bfloat16, got ", t);
  TORCH_CHECK_VALUE(kind >= 0 && kind <= 2, "pack_compare: kind must be 0 (not_le), 1 (gt) or "
                    "2 (between), got ", kind);
  if (x.device().is_cpu()) return pack_compare_cpu(x, kind, lo, hi, out);
  TORCH_CHECK_VALUE(!out.has_value(), "pack_compare: out is supported on the CPU only");
#ifdef ACTNN_ZOO_CUDA
  if (x.is_cuda()) {
    const c10::DeviceGuard guard(x.device());
    return pack_compare_cuda(x, kind, lo, hi);
  }
#endif
  TORCH_CHECK(false, "actnn_zoo._C.pack_compare: no kernel for tensors on ", x.device());
}

}  // namespace

void register_pack_compare(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("pack_compare", &pack_compare, py::call_guard<py::gil_scoped_release>(), py::arg("x"),
        py::arg("kind"), py::arg("lo"), py::arg("hi"), py::arg("out") = py::none(),
        "Contiguous float tensor -> ceil(n / 8) uint8: bit i % 8 of byte i // 8 is the predicate "
        "of element i; kind 0: !(x <= lo), 1: x > lo, 2: lo < x < hi. out (CPU): the buffer "
        "written into and returned, else a new one.");
}

}  // namespace actnn_zoo
