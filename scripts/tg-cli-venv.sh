#!/usr/bin/env bash
# Makes a Python venv with TrustGraph's CLI (trustgraph-cli from PyPI, unmodified) under
# ~/.cache/sluice/tg-venv and prints the path of its tg-list-models, for
#   TG_LIST_MODELS=$(bash scripts/tg-cli-venv.sh) cargo test -p sluice-tests --test gateway list_models
set -euo pipefail
version="${TG_VERSION:-2.11.1}"
venv="${TG_VENV:-$HOME/.cache/sluice/tg-venv}"
if [ ! -x "$venv/bin/tg-list-models" ]; then
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install -q "trustgraph-cli==$version" >&2
fi
echo "$venv/bin/tg-list-models"
