#!/usr/bin/env bash
# The main job: a real streamed completion, end to end, on the embedded default.
#
#   bash scripts/main.sh ["PROMPT"] ["SYSTEM PROMPT"]
#
# Obtains and starts the local LLM (llama-server + SmolLM2-135M, built once and cached under
# ~/.cache/sluice/llm), starts `sluice serve` (text-completion processor + gateway on the
# in-process bus) against it, streams the answer to the terminal with `sluice invoke llm`,
# and stops what it started. The first run on a fresh machine builds llama-server and sluice
# (about 20 minutes on 2 cores); later runs take seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
. scripts/prereqs.sh

PROMPT="${1:-Why is the sky blue? Answer in two sentences.}"
SYSTEM="${2:-You are a helpful, concise assistant.}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/sluice/target}"
GATEWAY="${SLUICE_MAIN_GATEWAY:-127.0.0.1:8088}"
METRICS="${SLUICE_MAIN_METRICS:-127.0.0.1:8000}"
LOG="${TMPDIR:-/tmp}/sluice-main.$$.log"

# protoc: pulsar-rs generates its protocol code at build time; the rest builds llama-server.
prereqs protoc:protobuf-compiler curl:curl cmake:cmake ninja:ninja-build unzip:unzip cc:build-essential
if ! command -v cargo >/dev/null 2>&1; then
  echo "cargo is missing: install Rust (https://rustup.rs) and run this again" >&2
  exit 1
fi

echo "== building sluice" >&2
cargo build --locked -q -p sluice-cli
SLUICE="$CARGO_TARGET_DIR/debug/sluice"

# A per-run key for the local server: sluice reads it from the environment, never argv.
export SLUICE_LLM_API_KEY="${SLUICE_LLM_API_KEY:-sluice-main-$RANDOM$RANDOM}"
echo "== local LLM" >&2
# Its own port, restarted so that it takes this run's key (tests use 8766).
export LLM_PORT="${SLUICE_MAIN_LLM_PORT:-8767}"
deploy/local-llm/llama-server.sh stop || true
deploy/local-llm/llama-server.sh start

serve_pid=
cleanup() {
  if [ -n "$serve_pid" ]; then kill -TERM "$serve_pid" 2>/dev/null || true; wait "$serve_pid" 2>/dev/null || true; fi
  deploy/local-llm/llama-server.sh stop || true
  rm -f "$LOG"
}
trap cleanup EXIT

echo "== sluice serve (log: $LOG)" >&2
"$SLUICE" serve --config deploy/serve/local-llm.toml --base-url "http://127.0.0.1:$LLM_PORT" \
  --listen "$GATEWAY" --metrics-addr "$METRICS" >"$LOG" 2>&1 &
serve_pid=$!
WAIT_INTERVAL=0.2 wait_ready 20 "sluice serve's /readyz" "$serve_pid" "$LOG" \
  quietly curl -sf -m 2 "http://$METRICS/readyz" || exit 1

echo "== sluice invoke llm (streamed)" >&2
"$SLUICE" invoke --url "http://$GATEWAY" --show-usage llm "$SYSTEM" "$PROMPT"
