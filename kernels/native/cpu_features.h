// What every native op needs to know about the CPU it runs on: the target its kernels are compiled for (per
// function, never -march=native: the binary must load on any x86-64) and whether this CPU has it, asked at
// run time. Two levels (kernels/cpu_isa.py): AVX512-BF16 for the bf16 ops, AVX2 + FMA (x86-64-v3) for the
// float32 ones. kernels/native/__init__.py puts the headers' hash in the build flags, so
// an edit here rebuilds every op.
#pragma once

#define AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

inline bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16");
}

#define AVX2_FMA __attribute__((target("avx2,fma,f16c")))

inline bool cpu_supports_avx2_fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
