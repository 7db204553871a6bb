#!/usr/bin/env bash
# Runs the benchmarks against a real Pulsar broker and writes their figures to
# bench/results/ and into the docs' tables (docs/*.md). Nothing here asserts on time.
#   bash bench/run.sh                    # the foundation scenario with default sizes
#   bash bench/run.sh foundation --round-trips 500 --requests 5000
#   bash bench/run.sh text-completion    # TTFT overhead, concurrent streams, tokens/s
#   bash bench/run.sh fallback           # TTFT through a fallback list vs the provider directly, and a move's cost
#   bash bench/run.sh gateway            # TTFT over HTTP through the gateway, requests/s
#   bash bench/run.sh loss               # what TrustGraph's non-persistent mapping loses, and when it is seen
#   bash bench/run.sh pacing             # TrustGraph's own client at 64 and 512 streams, unpaced and paced
#   bash bench/run.sh structured         # the local model's malformed JSON lines with and without native structured output
#   bash bench/run.sh overhead           # TTFT added over the provider: a bare pass-through, serve, the gateway over the broker, LiteLLM, TensorZero (+ PNG plot)
#   bash bench/run.sh overhead --only broker --callers 64 --token-gap-ms 20   # some targets, another token pace (overhead-partial.*)
#   BENCH_SERVE_BEFORE=/path/to/old/sluice bash bench/run.sh overhead --only serve --callers 1,64   # a change's before and after in one run
#   bash bench/run.sh timeline [--only serve]   # where one request's time goes, from perf's tracepoints (bench/timeline.py)
#   bash bench/run.sh soak --minutes 30  # the soak under chaos (its own broker on 6657)
#   bash bench/run.sh soak --minutes 30 --cluster  # the same on the secured cluster, its faults
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/sluice/target}"
deploy/pulsar/pulsar.sh start
export PULSAR_URL=pulsar://127.0.0.1:6650 PULSAR_ADMIN_URL=http://127.0.0.1:8080
# The broker's process, whose CPU the overhead scenario counts per target over it.
BENCH_BROKER_PID=$(cat "${PULSAR_STATE_DIR:-${SLUICE_CACHE:-$HOME/.cache/sluice}/pulsar-state/6650}/pid" 2>/dev/null || true)
export BENCH_BROKER_PID
# BENCH_PROFILE=debug runs the debug build (for the soak and loss scenarios, whose figures are
# about loss and memory, not speed, and where a release build would take too long).
if [ "${BENCH_PROFILE:-release}" = "debug" ]; then
  cargo build --locked -p sluice-bench -p sluice-cli
  bin="$CARGO_TARGET_DIR/debug"
else
  cargo build --release --locked -p sluice-bench -p sluice-cli
  bin="$CARGO_TARGET_DIR/release"
fi
# The soak's cluster mode needs the secured cluster (started if it is not running).
case " $* " in
  *" --cluster "*)
    deploy/pulsar/cluster.sh start
    eval "$(deploy/pulsar/cluster.sh env)"
    ;;
esac
# The pacing scenario reads the answers with TrustGraph's own client (PyPI, in a venv).
case " $* " in
  *" pacing "*) TG_FLOW_VENV=$(bash scripts/tg-flow-venv.sh); export TG_FLOW_VENV ;;
esac
# The structured scenario asks the real local model (started here when none serves).
case " $* " in
  *" structured "*)
    export SLUICE_LLM_API_KEY="${SLUICE_LLM_API_KEY:-sluice-bench-$RANDOM$RANDOM}"
    curl -sf -m 3 http://127.0.0.1:8766/health >/dev/null 2>&1 || deploy/local-llm/llama-server.sh start
    ;;
esac
# The overhead scenario compares LiteLLM's proxy (PyPI, pinned, in a venv with matplotlib for
# the plot) and TensorZero's gateway when bench/tensorzero.sh has built it.
case " $* " in
  *" overhead "*)
    BENCH_VENV=$(bash scripts/bench-venv.sh)
    LITELLM_VERSION=$("$BENCH_VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("litellm"))')
    export BENCH_VENV LITELLM_VERSION
    tz="${TENSORZERO_GATEWAY:-$HOME/.cache/sluice/tensorzero-target/release/gateway}"
    if [ -x "$tz" ]; then
      export TENSORZERO_GATEWAY="$tz" TENSORZERO_VERSION="${TENSORZERO_VERSION:-2026.4.0 (built by bench/tensorzero.sh)}"
    fi
    ;;
esac
scenario="${1:-foundation}"
[ $# -gt 0 ] && shift
# The timeline of a request at one caller (bench/timeline.py): the kernel's scheduler and
# system-call tracepoints (perf) around the overhead scenario's one-caller level, cut where the
# request and its first token cross between the processes. perf's data stays in the cache.
if [ "$scenario" = timeline ]; then
  . scripts/prereqs.sh
  prereqs perf:linux-perf
  dir="$HOME/.cache/sluice/timeline"
  rm -rf "$dir"
  [[ " $* " == *" --only"* ]] || set -- --only pass-through,serve,broker "$@"
  python3 bench/timeline.py record "$dir" -- "$bin/sluice-bench" --out "$dir/out" --docs "$dir/docs" \
    overhead --callers 1 --serial-requests 300 "$@"
  {
    echo "Measured $(date -u '+%Y-%m-%d %H:%M') UTC at commit $(git rev-parse --short HEAD) on this machine ($(nproc) cores, release build) by \`bash bench/run.sh timeline $*\`: perf's tracepoints around the overhead scenario's one-caller level (the fake provider's first token 50 ms after the request; every figure is a time on the kernel's clock, p50 and p90 over the requests)."
    echo
    echo '```'
    python3 bench/timeline.py report "$dir" --json bench/results/timeline.json --show 100
    echo '```'
  } >bench/results/timeline.md
  cat bench/results/timeline.md
  exit 0
fi
"$bin/sluice-bench" --out bench/results --docs docs "$scenario" "$@"
if [ "$scenario" = overhead ] && [[ " $* " != *" --only"* ]]; then
  mkdir -p docs/images && "$BENCH_VENV/bin/python" bench/plot.py bench/results/overhead.json docs/images/overhead.png
fi
