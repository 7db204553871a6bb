#!/usr/bin/env bash
# Makes a Python venv with OpenAI's official Python SDK (the `openai` package from PyPI,
# unmodified) under ~/.cache/sluice/openai-venv and prints the path of its python, for
#   OPENAI_PY=$(bash scripts/openai-venv.sh) cargo test -p sluice-tests --test openai_api --test responses_api
set -euo pipefail
version="${OPENAI_PY_VERSION:-3.54.0}"
venv="${OPENAI_VENV:-$HOME/.cache/sluice/openai-venv}"
if ! "$venv/bin/python" -c "import openai, sys; sys.exit(openai.__version__ != '$version')" 2>/dev/null; then
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install -q "openai==$version" >&2
fi
echo "$venv/bin/python"
