#!/usr/bin/env bash
# Print the CMake arguments llama.cpp's CPU kernels are built with on this machine: every instruction set it has,
# AVX-512 included (1.2x the prompt speed of an AVX2 build on Gemma-3-270M here), but never AMX: llama.cpp's default
# native build enables AMX kernels that crash on machines whose kernel does not grant AMX tile state (seen on our
# 2-core x86_64 machines). Prints nothing off x86_64 (llama.cpp's native build is right there).
set -euo pipefail
has_cpu_flag() { grep -qw "$1" /proc/cpuinfo; }
if [ "$(uname -m)" = x86_64 ]; then
  args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
  if has_cpu_flag avx512f && has_cpu_flag avx512cd && has_cpu_flag avx512vl && has_cpu_flag avx512dq \
      && has_cpu_flag avx512bw; then
    args="$args -DGGML_AVX512=ON"
    if has_cpu_flag avx512vbmi; then args="$args -DGGML_AVX512_VBMI=ON"; fi
    if has_cpu_flag avx512_vnni; then args="$args -DGGML_AVX512_VNNI=ON"; fi
    if has_cpu_flag avx512_bf16; then args="$args -DGGML_AVX512_BF16=ON"; fi
  fi
  if has_cpu_flag avx_vnni; then args="$args -DGGML_AVX_VNNI=ON"; fi
  printf '%s\n' "$args"
fi
