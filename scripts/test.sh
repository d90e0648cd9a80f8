#!/usr/bin/env bash
# Set up (if needed) and run every test; arguments go to pytest. The first-hour and packaging tests give themselves
# an empty home directory (tests/support/home.py, fresh_machine_home): a warm ~/.cache cannot hide a new machine's path.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The layers contract (pyproject.toml, [tool.importlinter]): each layer of ckpt_plugin imports only those below it.
.venv/bin/lint-imports
exec .venv/bin/python -m pytest "$@"
