#!/usr/bin/env bash
# Set up (if needed) and run the main job: ckpt-serve (llama_cpp.server with checkpoints) on the embedded default
# model, Gemma-3-270M. Extra arguments go to ckpt-serve (e.g. --port 8080 --admin true). Installs only the `serve`
# extra: no test dependencies, no redis-server.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh serve
exec .venv/bin/ckpt-serve --host "${HOST:-127.0.0.1}" --port "${PORT:-8000}" --n_ctx "${N_CTX:-4096}" "$@"
