#!/usr/bin/env bash
# sluice's processors in a TrustGraph deployment, beside TrustGraph's own unmodified processes
# (trustgraph-flow 2.11.1 from PyPI, in the venv of scripts/tg-flow-venv.sh), on the real
# broker, with TrustGraph's topic mapping throughout (issue #14.2). TrustGraph's bootstrapper,
# config service (tests/py/tg_config_svc.py: its own code, Cassandra replaced by memory),
# IAM (no-auth-svc), flow service and api-gateway run as tests/py/tg/up.sh starts them; the
# flow `default` comes from the blueprint in tests/py/tg/seed.json, started by TrustGraph's
# bootstrapper. The model is fake-openai (tests/src/bin/fake-openai.rs).
#
# Part 1: sluice's text-completion (--config-service) serves the flow; TrustGraph's prompt
#   service and agent call it. TrustGraph's CLI, through TrustGraph's api-gateway:
#   tg-invoke-llm (streaming and not; and TG_PARALLEL_LLM, default 24, streaming at once),
#   tg-list-models, tg-invoke-prompt, tg-invoke-agent.
# Part 2: TrustGraph's text-completion serves the flow; sluice's prompt and agent
#   (--config-service) call it: tg-invoke-prompt and tg-invoke-agent.
# Part 3: sluice's gateway (`sluice gateway --trustgraph`) in place of TrustGraph's
#   api-gateway on port 8888: tg-invoke-llm, tg-invoke-prompt and tg-invoke-agent with their
#   own defaults (no -u), another workspace and a wrong token refused.
#
#   bash scripts/test-trustgraph.sh            (needs a broker: PULSAR_URL, PULSAR_ADMIN_URL)
#
# Settings: SLUICE_BIN (default $CARGO_TARGET_DIR/debug/sluice, built if missing),
# TG_RUN_DIR (logs; default a fresh temporary directory, kept on failure).
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$(dirname "$0")/.."
export PULSAR_URL="${PULSAR_URL:-pulsar://127.0.0.1:6650}"
export PULSAR_ADMIN_URL="${PULSAR_ADMIN_URL:-http://127.0.0.1:8080}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/sluice/target}"
sluice="${SLUICE_BIN:-$CARGO_TARGET_DIR/debug/sluice}"
[ -x "$sluice" ] || cargo build -q -p sluice-cli --locked
run="${TG_RUN_DIR:-$(mktemp -d /tmp/sluice-tg.XXXXXX)}"
mkdir -p "$run"
export TG_RUN_DIR="$run"
venv=$(bash scripts/tg-flow-venv.sh)
export TG_FLOW_VENV="$venv"
tg="$venv/bin"
fake_port="${FAKE_OPENAI_PORT:-8767}"
metrics_base=8150

LOG_TAG="tg-test"
fail() {
  log "FAILED: $*"
  log "logs are in $run"
  for f in "$run"/*.log; do
    [ -e "$f" ] || continue
    echo "----- $(basename "$f") (last 25 lines)" >&2
    tail -n 25 "$f" >&2
  done
  exit 1
}

sluice_pids=()
passed=false
cleanup() {
  local pid
  for pid in "${sluice_pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  # up.sh stops what it started by the pid files in $run: remove them only after.
  tests/py/tg/up.sh stop || true
  if $passed; then rm -rf "$run"; else rmdir "$run" 2>/dev/null || true; fi
}
trap cleanup EXIT

# Fixed ports (TrustGraph's CLI talks to api-gateway on 8888): a process left from an
# earlier run would answer in place of this run's, so refuse to start instead.
for port in "$fake_port" 8888; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "port $port is in use (a TrustGraph process left from an earlier run?): stop it first" >&2
    exit 1
  fi
done

# serves_one_flow PORT: whether the sluice process with metrics on PORT serves one flow.
serves_one_flow() { curl -sf "http://127.0.0.1:$1/metrics" | grep -q '^sluice_config_flows{[^}]*} 1$'; }

# Starts `sluice ARGS` in the background, its log in $run/NAME.log, and waits for its
# /readyz and for its first flow.
start_sluice() { # name, metrics port, args...
  local name="$1" port="$2"; shift 2
  log "starting sluice $name: $*"
  RUST_LOG=info "$sluice" "$@" --config-service --topic-mapping trustgraph \
    --pulsar-url "$PULSAR_URL" --metrics-addr "127.0.0.1:$port" > "$run/sluice-$name.log" 2>&1 &
  sluice_pids+=($!)
  echo $! > "$run/sluice-$name.spid"
  local t0=$SECONDS
  WAIT_INTERVAL=1 wait_ready 120 "sluice $name taking up flow default/default" "$(cat "$run/sluice-$name.spid")" \
    "$run/sluice-$name.log" serves_one_flow "$port" || fail "sluice $name did not take up flow default/default"
  curl -sf "http://127.0.0.1:$port/readyz" > /dev/null || fail "sluice $name is not ready"
  log "sluice $name serves flow default/default ($((SECONDS - t0))s)"
}

stop_sluice() { # name
  local pid
  pid=$(cat "$run/sluice-$1.spid")
  kill -TERM "$pid"
  wait "$pid" || fail "sluice $1 did not exit cleanly on SIGTERM"
}

# A sluice counter: the sum of the samples of NAME on PORT whose labels contain LABELS.
counter() { # port, name, labels
  curl -sf "http://127.0.0.1:$1/metrics" | awk -v n="$2" -v l="$3" \
    'index($0, n "{") == 1 && index($0, l) { s += $NF } END { print s + 0 }'
}

expect() { # what, needle, command...
  local what="$1" needle="$2" out; shift 2
  out=$(timeout 120 "$@" 2>&1) || fail "$what: exit $?: $out"
  case "$out" in
    *"$needle"*) log "ok: $what" ;;
    *) fail "$what: expected '$needle' in: $out" ;;
  esac
}

log "part 1: TrustGraph's prompt and agent, sluice's text-completion"
TG_PROCESSORS="prompt agent-manager" tests/py/tg/up.sh start || fail "TrustGraph did not come up"
export OPENAI_BASE_URL="http://127.0.0.1:$fake_port/v1"
SLUICE_LLM_API_KEY=unused start_sluice text-completion "$metrics_base" text-completion \
  --provider openai-compatible --base-url "$OPENAI_BASE_URL" --model sluice-default

expect "tg-invoke-llm, streaming, through api-gateway to sluice" \
  "fake reply: Say hello" "$tg/tg-invoke-llm" "Be terse." "Say hello"
expect "tg-invoke-llm --no-streaming" \
  "fake reply: Say goodbye" "$tg/tg-invoke-llm" --no-streaming "Be terse." "Say goodbye"
# Issue #28: many streaming tg-invoke-llm at once through TrustGraph's api-gateway (one
# Python consumer for all of sluice's answers). Each answer's chunks come back to back, so
# sluice's pacing (on by default on these non-persistent topics) merges them: every client
# must still print its whole answer, and sluice must have merged deltas.
parallel="${TG_PARALLEL_LLM:-24}"
log "$parallel streaming tg-invoke-llm at once"
llm_pids=()
for i in $(seq 1 "$parallel"); do
  timeout 180 "$tg/tg-invoke-llm" "Be terse." "parallel caller $i asks for a reply long enough to span several chunks" \
    > "$run/parallel-llm-$i.out" 2>&1 &
  llm_pids+=($!)
done
for i in $(seq 1 "$parallel"); do
  wait "${llm_pids[$((i - 1))]}" || fail "parallel tg-invoke-llm $i: exit $?: $(cat "$run/parallel-llm-$i.out")"
  grep -qF "fake reply: parallel caller $i asks for a reply long enough to span several chunks" "$run/parallel-llm-$i.out" ||
    fail "parallel tg-invoke-llm $i did not print its whole answer: $(cat "$run/parallel-llm-$i.out")"
done
merged=$(counter "$metrics_base" sluice_processor_deltas_coalesced_total 'processor=')
[ "${merged%.*}" -ge 1 ] || fail "sluice's text-completion merged no delta: pacing was off"
log "ok: $parallel parallel streaming tg-invoke-llm each printed its whole answer ($merged deltas merged by sluice's pacing)"
# The flow's model (the blueprint's llm-model parameter, fake-model) comes first.
expect "tg-list-models lists the flow's model" "fake-model" "$tg/tg-list-models"
expect "tg-invoke-prompt: TrustGraph's prompt service calls sluice" \
  "fake reply: What is 3+3?" "$tg/tg-invoke-prompt" question 'question=What is 3+3?'
expect "tg-invoke-agent: TrustGraph's agent calls sluice" \
  "fake answer to" "$tg/tg-invoke-agent" -q "What is 3+3?"
served=$(counter "$metrics_base" sluice_processor_requests_total 'outcome="success"')
[ "${served%.*}" -ge $((5 + parallel)) ] || fail "sluice's text-completion answered $served requests, not all of them"
log "sluice's text-completion answered $served requests"
stop_sluice text-completion
for p in prompt agent-manager; do kill "$(cat "$run/$p.pid")" 2>/dev/null || true; rm -f "$run/$p.pid"; done

log "part 2: TrustGraph's text-completion, sluice's prompt and agent"
"$tg/text-completion-openai" -p "$PULSAR_URL" --pulsar-admin-url "$PULSAR_ADMIN_URL" \
  --no-loki-enabled -P "$((metrics_base + 5))" --id text-completion -u "$OPENAI_BASE_URL" \
  -m fake-model > "$run/text-completion.log" 2>&1 &
echo $! > "$run/text-completion.pid"
WAIT_INTERVAL=1 wait_until 120 "TrustGraph's text-completion to start the flow" \
  grep -qF "Started flow: default/default" "$run/text-completion.log" ||
  fail "TrustGraph's text-completion did not start the flow"
start_sluice prompt "$((metrics_base + 1))" prompt
start_sluice agent "$((metrics_base + 2))" agent
# TrustGraph's text-completion sends the system prompt and the prompt as one user message,
# which the fake model echoes.
expect "tg-invoke-prompt: sluice's prompt service calls TrustGraph's text-completion" \
  "What is 4+4?" "$tg/tg-invoke-prompt" question 'question=What is 4+4?'
expect "tg-invoke-agent: sluice's agent calls TrustGraph's text-completion" \
  "fake answer to" "$tg/tg-invoke-agent" -q "What is 4+4?"
for port in $((metrics_base + 1)) $((metrics_base + 2)); do
  n=$(counter "$port" sluice_processor_requests_total 'outcome="success"')
  [ "${n%.*}" -ge 1 ] || fail "the sluice processor with metrics on $port answered nothing"
done

log "part 3: sluice's gateway in TrustGraph's place (--trustgraph), TrustGraph's CLI with its defaults"
# TrustGraph's api-gateway leaves port 8888 to sluice's gateway, which finds the flow's
# topics as TrustGraph's flow service named them; the CLI is given no -u, only its token in
# TRUSTGRAPH_TOKEN, as a TrustGraph user sets it.
kill "$(cat "$run/api-gateway.pid")" 2>/dev/null || true
rm -f "$run/api-gateway.pid"
WAIT_INTERVAL=1 wait_until 60 "TrustGraph's api-gateway to leave port 8888" \
  bash -c '! (exec 3<>/dev/tcp/127.0.0.1/8888) 2>/dev/null' || fail "port 8888 stayed in use"
gw_token="tg-part3-$RANDOM$RANDOM"
SLUICE_GATEWAY_TOKEN="$gw_token" RUST_LOG=info "$sluice" gateway --trustgraph \
  --pulsar-url "$PULSAR_URL" --metrics-addr "127.0.0.1:$((metrics_base + 3))" > "$run/sluice-gateway.log" 2>&1 &
sluice_pids+=($!)
echo $! > "$run/sluice-gateway.spid"
WAIT_INTERVAL=1 wait_ready 120 "sluice's gateway listening on 8888" "$(cat "$run/sluice-gateway.spid")" \
  "$run/sluice-gateway.log" grep -qF "gateway listening on 0.0.0.0:8888" "$run/sluice-gateway.log" ||
  fail "sluice's gateway did not listen on 8888"
with_token=(env "TRUSTGRAPH_TOKEN=$gw_token")
expect "tg-invoke-llm (no -u) through sluice's gateway to TrustGraph's text-completion" \
  "What is 5+5?" "${with_token[@]}" "$tg/tg-invoke-llm" "Be terse." "What is 5+5?"
expect "tg-invoke-llm --no-streaming through sluice's gateway" \
  "What is 6+6?" "${with_token[@]}" "$tg/tg-invoke-llm" --no-streaming "Be terse." "What is 6+6?"
expect "tg-invoke-prompt through sluice's gateway to sluice's prompt" \
  "What is 7+7?" "${with_token[@]}" "$tg/tg-invoke-prompt" question 'question=What is 7+7?'
expect "tg-invoke-agent through sluice's gateway to sluice's agent" \
  "fake answer to" "${with_token[@]}" "$tg/tg-invoke-agent" -q "What is 8+8?"
# Another workspace is refused, not answered from this one's flow; a wrong token too. (The
# CLI prints "Exception: ..." and exits 0 on both, so its output is what tells.)
out=$(timeout 60 "${with_token[@]}" "$tg/tg-invoke-llm" -w elsewhere "Be terse." "Hi elsewhere" 2>&1) || true
case "$out" in *'unknown workspace "elsewhere"'*) ;;
  *) fail "tg-invoke-llm -w elsewhere: expected 'unknown workspace' in: $out" ;; esac
case "$out" in *"Hi elsewhere"*) fail "tg-invoke-llm -w elsewhere was answered: $out" ;; esac
log "ok: another workspace is refused"
out=$(TRUSTGRAPH_TOKEN=wrong timeout 60 "$tg/tg-invoke-llm" "Be terse." "Hi stranger" 2>&1) || true
case "$out" in *"auth failure"*) ;;
  *) fail "tg-invoke-llm with a wrong token: expected 'auth failure' in: $out" ;; esac
case "$out" in *"Hi stranger"*) fail "tg-invoke-llm with a wrong token was answered: $out" ;; esac
log "ok: a wrong token is refused"
stop_sluice gateway
stop_sluice prompt
stop_sluice agent
log "all TrustGraph interoperability checks passed"
passed=true
