// What every native op needs to know about the CPU it runs on: the AVX512-BF16 target its kernels are
// compiled for (per function, never -march=native: the binary must load on any x86-64), and whether this
// CPU has it, asked at run time. kernels/native/__init__.py puts the headers' hash in the build flags, so
// an edit here rebuilds every op.
#pragma once

#define AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

inline bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16");
}
