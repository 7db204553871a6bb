#!/usr/bin/env bash
# What one streamed chat completion costs `sluice serve` in instructions: a figure that does
# not move with the machine's noise (valgrind's callgrind counts instructions, not seconds;
# the same binary, requests and environment give the same count), for before/after ratios of
# changes to the request path.
#
#   bash bench/instructions.sh [REQUESTS] [SLUICE_BIN]     # default 200, the release build
#   BENCH_SERVE_BEFORE=/path/to/old/sluice bash bench/instructions.sh   # and an earlier build
#
# `sluice serve` (release build, RUST_LOG=warn as the overhead scenario runs it, and again at
# the default INFO) answers REQUESTS sequential `POST /v1/chat/completions` (stream: true)
# from the tests' fake OpenAI server (fake-openai: "fake reply: bench" in 3 content chunks
# after the role chunk, then finish, usage and [DONE]); the counters are zeroed after 30
# warm-up requests. Writes bench/results/instructions.md: instructions per request, and the
# functions with the largest inclusive share.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
LOG_TAG=instructions
requests="${1:-200}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/sluice/target}"
bin="${2:-$CARGO_TARGET_DIR/release/sluice}"
command -v valgrind >/dev/null || fail "valgrind is needed (apt-get install valgrind)"
[ -x "$bin" ] || cargo build --release --locked -p sluice-cli
fake=$(fake_openai_bin)
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

fake_port=$(free_port)
"$fake" --port "$fake_port" >"$work/fake.log" 2>&1 &
pids+=($!)
wait_ready 10 fake-openai "${pids[0]}" "$work/fake.log" quietly curl -sf "http://127.0.0.1:$fake_port/v1/models" ||
  fail "fake-openai did not start"

body='{"model":"fake-model","stream":true,"messages":[{"role":"user","content":"bench"}]}'
# count LEVEL [BIN]: instructions per request of `sluice serve` (BIN, default this build's) at
# log level LEVEL; also leaves the callgrind file at $work/cg.LEVEL.
count() {
  local level=$1 exe=${2:-$bin} port metrics pid
  port=$(free_port)
  metrics=$(free_port)
  RUST_LOG=$level valgrind --tool=callgrind --callgrind-out-file="$work/cg.$level" --dump-instr=no \
    "$exe" serve --provider openai-compatible --base-url "http://127.0.0.1:$fake_port" \
    --model fake-model --listen "127.0.0.1:$port" --metrics-addr "127.0.0.1:$metrics" \
    >"$work/serve.$level.log" 2>&1 &
  pid=$!
  pids+=("$pid")
  wait_ready 120 "sluice serve under callgrind" "$pid" "$work/serve.$level.log" \
    quietly curl -sf "http://127.0.0.1:$metrics/readyz" || fail "sluice serve did not start"
  local url="http://127.0.0.1:$port/v1/chat/completions"
  ask() { curl -sfN -m 30 -H 'Content-Type: application/json' -d "$body" "$url" >/dev/null; }
  for _ in $(seq 30); do ask; done
  callgrind_control --zero "$pid" >/dev/null 2>&1
  for _ in $(seq "$requests"); do ask; done
  callgrind_control --dump "$pid" >/dev/null 2>&1
  kill "$pid"
  wait "$pid" 2>/dev/null || true
  local total
  total=$(callgrind_annotate "$work/cg.$level.1" 2>/dev/null | awk '/PROGRAM TOTALS/ { gsub(",", "", $1); print $1; exit }')
  echo $((total / requests))
}

# BENCH_SERVE_BEFORE: another build's binary, counted the same way (a change's before).
if [ -n "${BENCH_SERVE_BEFORE:-}" ]; then
  before_warn=$(count warn "$BENCH_SERVE_BEFORE")
  before_info=$(count info "$BENCH_SERVE_BEFORE")
fi
warn=$(count warn)
info=$(count info)
commit=$(git rev-parse --short HEAD)
out=bench/results/instructions.md
{
  echo "Measured $(date -u '+%Y-%m-%d %H:%M') UTC at commit $commit$([ -z "$(git status --porcelain -- services schema)" ] || echo ' with uncommitted changes') on this machine ($(nproc) cores) by \`bash bench/instructions.sh $requests\`: \`sluice serve\` (release build) answering $requests streamed chat completions from fake-openai (3 content chunks each), under valgrind's callgrind."
  echo
  if [ -n "${BENCH_SERVE_BEFORE:-}" ]; then
    echo "| log level | instructions per request | before ($(basename "$BENCH_SERVE_BEFORE")) | after / before |"
    echo "|---|---|---|---|"
    echo "| warn (as the overhead scenario runs it) | $warn | $before_warn | $(awk "BEGIN { printf \"%.3f\", $warn / $before_warn }") |"
    echo "| info (the default) | $info | $before_info | $(awk "BEGIN { printf \"%.3f\", $info / $before_info }") |"
  else
    echo "| log level | instructions per request |"
    echo "|---|---|"
    echo "| warn (as the overhead scenario runs it) | $warn |"
    echo "| info (the default) | $info |"
  fi
  echo
  echo "The functions with the largest inclusive share at warn (each counted with what it calls):"
  echo
  echo '```'
  callgrind_annotate --inclusive=yes --threshold=100 "$work/cg.warn.1" 2>/dev/null |
    grep -E '^\s*[0-9,]+ \(' |
    sed -E 's#/root/.cargo/registry/src/index.crates.io-[0-9a-f]+/##; s#/rustc/[0-9a-f]+/library/##; s# \[[^]]*\]$##' |
    grep -E 'sluice|serde_json|eventsource|url-|hyper|reqwest|axum|jemalloc|fmt' |
    awk '!seen[$0]++' | head -60
  echo '```'
} >"$out"
log "warn: $warn, info: $info instructions per request; written to $out"
