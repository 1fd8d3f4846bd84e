// CPU randomized Walsh-Hadamard transform per group (see hadamard.h for the definition).
// One group at a time per OpenMP thread, in place: the butterfly's inner loop runs over
// contiguous columns and vectorises for stages h >= 8.
#include "hadamard.h"

#include <ATen/record_function.h>
#include <c10/core/DeviceGuard.h>

#include <cmath>

namespace actnn_zoo {

void check_hadamard_args(const at::Tensor& x2d, int64_t group_size) {
  TORCH_CHECK(x2d.dim() == 2, "hadamard: x2d must be 2-d (N, D), got ", x2d.dim(), " dims");
  TORCH_CHECK(x2d.scalar_type() == at::kFloat, "hadamard: x2d must be float32, got ",
              x2d.scalar_type());
  TORCH_CHECK(x2d.is_contiguous(), "hadamard: x2d must be contiguous");
  TORCH_CHECK(group_size >= kHadamardMinGroup && group_size <= kHadamardMaxGroup &&
                  (group_size & (group_size - 1)) == 0,
              "hadamard: group_size must be a power of two in [", kHadamardMinGroup, ", ",
              kHadamardMaxGroup, "], got ", group_size);
}

namespace {

void butterflies(float* __restrict v, int64_t g) {
  for (int64_t h = 1; h < g; h <<= 1) {
    for (int64_t i = 0; i < g; i += 2 * h) {
      float* __restrict a = v + i;
      float* __restrict b = v + i + h;
#pragma omp simd
      for (int64_t k = 0; k < h; ++k) {
        const float x = a[k];
        const float y = b[k];
        a[k] = x + y;
        b[k] = x - y;
      }
    }
  }
}

}  // namespace

at::Tensor hadamard_cpu(at::Tensor& x2d, int64_t group_size, int64_t seed, bool inverse) {
  check_hadamard_args(x2d, group_size);
  const int64_t n = x2d.size(0), d = x2d.size(1), g = group_size;
  const int64_t full = d / g;  // groups per row the transform covers
  if (n == 0 || full == 0) return x2d;
  const uint32_t key = hadamard_key(static_cast<uint32_t>(seed));
  // 1 / sqrt(g) rounded once to float32: the torch reference multiplies by the same float.
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(g)));
  float* base = x2d.data_ptr<float>();
  const int64_t tasks = n * full;
#pragma omp parallel for schedule(static) if (tasks * g >= 32768)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t row = t / full, col0 = (t % full) * g;
    float* __restrict v = base + row * d + col0;
    if (!inverse) {
      for (int64_t k = 0; k < g; ++k) v[k] *= hadamard_sign(col0 + k, key);
    }
    butterflies(v, g);
    if (inverse) {
      for (int64_t k = 0; k < g; ++k) v[k] = (v[k] * scale) * hadamard_sign(col0 + k, key);
    } else {
#pragma omp simd
      for (int64_t k = 0; k < g; ++k) v[k] *= scale;
    }
  }
  return x2d;
}

namespace {

at::Tensor hadamard_(at::Tensor x2d, int64_t group_size, int64_t seed, bool inverse) {
  RECORD_USER_SCOPE("actnn_zoo::hadamard_");
  if (x2d.device().is_cpu()) return hadamard_cpu(x2d, group_size, seed, inverse);
#ifdef ACTNN_ZOO_CUDA
  if (x2d.is_cuda()) {
    const c10::DeviceGuard guard(x2d.device());
    return hadamard_cuda(x2d, group_size, seed, inverse);
  }
#endif
  TORCH_CHECK(false, "actnn_zoo._C.hadamard_: no kernel for tensors on ", x2d.device(),
              " in this build");
}

}  // namespace

void register_hadamard(pybind11::module_& m) {
  m.def("hadamard_", &hadamard_, pybind11::call_guard<pybind11::gil_scoped_release>(),
        pybind11::arg("x2d"), pybind11::arg("group_size"), pybind11::arg("seed"),
        pybind11::arg("inverse"),
        "In place on contiguous float32 (N, D): per full group of group_size (a power of two in "
        "[32, 8192]) the randomized Walsh-Hadamard transform H (s * x) / sqrt(g), or with "
        "inverse=True its inverse s * (H y) / sqrt(g); the last D % group_size columns are left "
        "as they are. Returns x2d.");
}

}  // namespace actnn_zoo
