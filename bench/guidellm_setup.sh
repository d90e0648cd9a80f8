#!/usr/bin/env bash
# Set up GuideLLM for bench/guidellm_runs.py, offline: a venv of its own (.cache/guidellm-venv, so that the
# project's venv keeps its dependencies) with guidellm 0.8.1, and a Hugging Face tokenizer directory built from the
# Gemma-3-270M GGUF file itself (.cache/guidellm-tokenizer), since GuideLLM needs a tokenizer ("processor") and
# nothing can be downloaded from the Hugging Face hub here. Then checks that the tokenizer splits text exactly as
# llama.cpp does (bench/guidellm_runs.py --check-tokenizer). Idempotent: a step whose result is there is skipped.
# Usage: bash bench/guidellm_setup.sh   (about a minute the first time here, torch's CPU wheel included)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=".cache/guidellm-venv"
tokenizer=".cache/guidellm-tokenizer"
guidellm_version="0.8.1"

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
installed="import importlib.metadata as m, sys; sys.exit(m.version('guidellm') != '$guidellm_version')"
if ! "$venv/bin/python" -c "$installed" 2>/dev/null; then
  # guidellm requires torch. PyPI's Linux torch pulls the CUDA libraries (gigabytes); where a CPU-only wheel lies in
  # pip's find-links directory (PIP_FIND_LINKS), pin to it. gguf: transformers reads the tokenizer from the GGUF.
  torch="torch"
  for dir in ${PIP_FIND_LINKS:-} $("$venv/bin/python" -m pip config get global.find-links 2>/dev/null || true); do
    wheel="$(ls "$dir"/torch-*+cpu-*.whl 2>/dev/null | sort -V | tail -1 || true)"
    if [ -n "$wheel" ]; then
      torch="torch==$(basename "$wheel" | cut -d- -f2)"
    fi
  done
  "$venv/bin/python" -m pip install --quiet "$torch" "guidellm==$guidellm_version" "gguf>=0.10" sentencepiece
fi

if [ ! -f "$tokenizer/tokenizer.json" ]; then
  rm -rf "$tokenizer" "$tokenizer.tmp"
  model="$(.venv/bin/python -c 'import sys; sys.path.insert(0, "bench"); import _common; print(_common.gemma_path())')"
  # transformers converts the GGUF's vocabulary, merges and special tokens into a tokenizers.json (no weights read).
  "$venv/bin/python" - "$model" "$tokenizer" <<'EOF'
import pathlib
import sys

from transformers import AutoTokenizer

model, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
tokenizer = AutoTokenizer.from_pretrained(str(model.parent), gguf_file=model.name)
tmp = out.with_name(out.name + ".tmp")
tokenizer.save_pretrained(str(tmp))
tmp.rename(out)
print(f"tokenizer: {out} ({type(tokenizer).__name__}, {len(tokenizer)} tokens)")
EOF
fi

.venv/bin/python bench/guidellm_runs.py --check-tokenizer
