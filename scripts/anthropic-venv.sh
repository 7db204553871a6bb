#!/usr/bin/env bash
# Makes a Python venv with Anthropic's official Python SDK (the `anthropic` package from PyPI,
# unmodified) under ~/.cache/sluice/anthropic-venv and prints the path of its python, for
#   ANTHROPIC_PY=$(bash scripts/anthropic-venv.sh) cargo test -p sluice-tests --test anthropic_api
set -euo pipefail
version="${ANTHROPIC_PY_VERSION:-0.75.0}"
venv="${ANTHROPIC_VENV:-$HOME/.cache/sluice/anthropic-venv}"
if ! "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('anthropic') != '$version')" 2>/dev/null; then
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install -q "anthropic==$version" >&2
fi
echo "$venv/bin/python"
