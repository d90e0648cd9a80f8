#!/usr/bin/env bash
# Create .venv/ in the repository root and install ckpt_plugin with its test dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."

# The shared tier's tests start their own redis-server (Debian package redis-server).
if ! command -v redis-server >/dev/null 2>&1; then
  apt-get update
  DEBIAN_FRONTEND=noninteractive apt-get install -y redis-server
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip wheel

# llama-cpp-python compiles llama.cpp (~8 min the first time; pip reuses the built wheel afterwards).
# A portable AVX2 build: llama.cpp's default native build enables AMX kernels that crash on machines whose
# kernel does not grant AMX tile state (seen on our 2-core x86_64 machines).
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON}"
.venv/bin/python -m pip install --quiet -e ".[test]"

# llama-cpp-python's own test suite runs against the plugin (tests/test_upstream_suite.py): its sdist, through pip.
if [ ! -f .cache/upstream/.done ]; then
  version="$(.venv/bin/python -c 'import llama_cpp; print(llama_cpp.__version__)')"
  mkdir -p .cache/upstream
  .venv/bin/python -m pip download --quiet --no-deps --no-binary :all: \
    "llama-cpp-python==${version}" -d .cache/upstream && touch .cache/upstream/.done
fi
