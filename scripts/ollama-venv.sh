#!/usr/bin/env bash
# Makes a Python venv with Ollama's official Python client (the `ollama` package from PyPI,
# unmodified) under ~/.cache/sluice/ollama-venv and prints the path of its python, for
#   OLLAMA_PY=$(bash scripts/ollama-venv.sh) cargo test -p sluice-tests --test ollama_api
set -euo pipefail
version="${OLLAMA_PY_VERSION:-0.6.3}"
venv="${OLLAMA_VENV:-$HOME/.cache/sluice/ollama-venv}"
if ! "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('ollama') != '$version')" 2>/dev/null; then
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install -q "ollama==$version" >&2
fi
echo "$venv/bin/python"
