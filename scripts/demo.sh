#!/usr/bin/env bash
# Set up (if needed) and run the main job on the embedded default model (Gemma-3-270M).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m ckpt_plugin.hosts.llama_cpp.serving.demo "$@"
