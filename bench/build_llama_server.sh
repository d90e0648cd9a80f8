#!/usr/bin/env bash
# Build C++ llama-server from the llama.cpp that llama-cpp-python vendors (the same sources as the package's
# library), with the same CPU kernels (scripts/cpu_cmake_args.sh), so that bench/concurrent_chat.py and
# bench/chat.py compare servers over one llama.cpp. Prints the executable's path; put its directory on PATH.
# About 10 minutes on 2 cores. Usage: bash bench/build_llama_server.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-.cache/llama-server}"
version="$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))')"
sdist=".cache/upstream/llama_cpp_python-$version.tar.gz"
if [ ! -f "$sdist" ]; then
  mkdir -p .cache/upstream
  .venv/bin/python -m pip download --quiet --no-deps --no-binary :all: -d .cache/upstream "llama-cpp-python==$version"
fi
mkdir -p "$build"
tar -xzf "$sdist" -C "$build"
source_dir="$build/llama_cpp_python-$version/vendor/llama.cpp"
# shellcheck disable=SC2046  # the arguments are words
cmake -S "$source_dir" -B "$build/out" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF $(bash scripts/cpu_cmake_args.sh) >/dev/null
cmake --build "$build/out" --target llama-server -j "$(nproc)" >/dev/null
realpath "$build/out/bin/llama-server"
