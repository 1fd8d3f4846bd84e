// Runtime choice of the x86 instruction set for the CPU kernels' hot loops.
//
// The extension is built portable (plain x86-64: SSE2) unless ACTNN_ZOO_NATIVE=1, so that it
// runs on any x86-64 CPU. SSE2 has no 32-bit lane multiply and no per-lane variable shift,
// which the counter hash of quantize and the code unpacking of dequantize need: those loops
// then run scalar, 4-6x slower than with AVX2. run_fast(f) calls f through a copy of itself
// compiled for AVX2 (GCC's `target` + `flatten`: every call inside is inlined and compiled for
// that target, so the `#pragma omp simd` loops are vectorised with 256-bit registers) when the
// CPU has AVX2, else calls f as it is. The arithmetic is the same either way (no FMA is enabled
// and -ffp-contract=off holds, and no float sum is vectorised: only min/max reductions are), so
// results are bit-identical on both paths -- up to the sign of a zero group minimum when a group
// holds both +0.0 and -0.0 (min/max pick an order-dependent zero, as the CUDA twin documents);
// tests/test_cpu_isa.py checks it by running the baseline path in a child process.
//
// ACTNN_ZOO_CPU_ISA=baseline (read once, at the first kernel call) forces the portable path.
#pragma once
#include <cstdlib>
#include <cstring>

namespace actnn_zoo {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__AVX2__)
#define ACTNN_ZOO_ISA_DISPATCH 1

template <typename F>
__attribute__((target("avx2,bmi,bmi2,popcnt,f16c"), flatten)) inline void run_avx2(const F& f) {
  f();
}

inline bool cpu_has_avx2() {
  static const bool yes = [] {
    const char* env = std::getenv("ACTNN_ZOO_CPU_ISA");
    if (env != nullptr && std::strcmp(env, "baseline") == 0) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi2") &&
           __builtin_cpu_supports("f16c");
  }();
  return yes;
}
#endif

// f() on the widest instruction set this CPU offers (see above).
template <typename F>
inline void run_fast(const F& f) {
#ifdef ACTNN_ZOO_ISA_DISPATCH
  if (cpu_has_avx2()) {
    run_avx2(f);
    return;
  }
#endif
  f();
}

// What run_fast runs: "avx2" or "baseline" (multiversioned build), "native" (a build whose
// compiler flags already enable AVX2, or a non-x86 / non-GCC build: one path).
inline const char* cpu_isa() {
#ifdef ACTNN_ZOO_ISA_DISPATCH
  return cpu_has_avx2() ? "avx2" : "baseline";
#else
  return "native";
#endif
}

}  // namespace actnn_zoo
