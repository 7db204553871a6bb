#!/usr/bin/env bash
# Prints the path of TrustGraph's tg-list-models (trustgraph-cli from PyPI, unmodified), for
#   TG_LIST_MODELS=$(bash scripts/tg-cli-venv.sh) cargo test --workspace --test gateway list_models
# It is the CLI of the one TrustGraph venv, scripts/tg-flow-venv.sh's (every package pinned
# there): a second venv would install the same trustgraph-cli again, with unpinned
# dependencies.
set -euo pipefail
venv=$(bash "$(dirname "${BASH_SOURCE[0]}")/tg-flow-venv.sh")
[ -x "$venv/bin/tg-list-models" ] || { echo "no tg-list-models in $venv" >&2; exit 1; }
echo "$venv/bin/tg-list-models"
