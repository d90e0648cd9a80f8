#!/usr/bin/env bash
# Set up (if needed, with the bench-only extras) and run all six benchmark workloads; writes docs/benchmarks.md.
# Put a C++ `llama-server` on PATH to include it in the interleaved-chat comparison (bench/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pip install --quiet -e ".[bench]"
exec .venv/bin/python bench/run_all.py "$@"
