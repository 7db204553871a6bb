#!/usr/bin/env bash
# Builds the documentation book (docs/, mdBook) and fails on any warning or error mdBook
# prints. mdBook itself checks neither links nor pages left out of docs/SUMMARY.md:
# tests/tests/docs.rs does (in the test command's tests stage).
#   bash scripts/docs.sh            # install mdBook when missing, then build the book
#   bash scripts/docs.sh install    # only install mdBook (the test command does this early)
# The book is written to ~/.cache/sluice/book (index.html): outside the clone, like every
# other build here. mdBook is installed by cargo into ~/.cache/sluice/cargo-bin.
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE="${SLUICE_CACHE:-$HOME/.cache/sluice}"
MDBOOK_VERSION=0.5.4
MDBOOK="$CACHE/cargo-bin/bin/mdbook"

install() {
  if "$MDBOOK" --version 2>/dev/null | grep -qx "mdbook v$MDBOOK_VERSION"; then return; fi
  echo "== installing mdBook $MDBOOK_VERSION (cargo install, ~3 min of both cores once)" >&2
  # Without the `serve` and `watch` features: no web server or file watcher to build.
  CARGO_TARGET_DIR="$CACHE/cargo-install-target" cargo install mdbook --locked \
    --version "$MDBOOK_VERSION" --no-default-features --features search \
    --root "$CACHE/cargo-bin"
}

install
[ "${1:-build}" = install ] && exit 0

out="$CACHE/book"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! "$MDBOOK" build docs --dest-dir "$out" >"$log" 2>&1; then
  cat "$log" >&2
  echo "mdbook build failed" >&2
  exit 1
fi
if grep -E '(WARN|ERROR)' "$log" >&2; then
  echo "mdbook build printed warnings (above)" >&2
  exit 1
fi
echo "the book: $out/index.html ($(find "$out" -name '*.html' | wc -l) pages)"
