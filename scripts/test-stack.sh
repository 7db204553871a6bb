#!/usr/bin/env bash
# Runs sluice the way a compose user does, on this machine, and checks it end to end:
#
#  1. the images: local stand-ins for the registry's bases, then sluice's own with the real
#     Dockerfile (scripts/stack-images.sh; no image registry is reachable here);
#  2. `docker compose up --wait` of docker-compose.yml plus tests/stack/docker-compose.override.yml
#     (the provider, ephemeral host ports, Debian's Prometheus, no Grafana: see that file);
#  3. streamed answers through the gateway container (`sluice invoke llm|prompt|agent`), the
#     OpenAI route, TrustGraph's WebSocket client when its venv is there, and faults on demand
#     (429, 500, an unknown template, a cancelled stream);
#  4. Prometheus: every job's targets up, every alert of deploy/prometheus/alerts.yml loaded
#     and healthy, `promtool check config` and `check rules`, and every PromQL expression of
#     every panel of deploy/grafana/dashboards/sluice.json returning data;
#  5. `--scale text-completion=3`: every replica serves requests, and a replica killed with
#     `docker kill -s KILL` mid-stream does not lose the caller's answer;
#  6. `docker compose down -v`, leaving no container, network or volume behind.
#
# Usage: scripts/test-stack.sh. Needs root (dockerd, mmdebstrap). Starts dockerd when none
# runs, and the local LLM (deploy/local-llm/llama-server.sh) when it is not serving.
# Figures (image size, start to /readyz, phase times) are printed at the end and written to
# $SLUICE_STACK_FIGURES when set.
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$(dirname "$0")/.."

PROJECT="sluice-stack-$$"
WORK=$(mktemp -d)
LLM_PORT="${LLM_PORT:-8766}"
KEY_GIVEN=0
[ -n "${SLUICE_LLM_API_KEY:-}" ] && KEY_GIVEN=1
export SLUICE_LLM_API_KEY="${SLUICE_LLM_API_KEY:-sluice-stack-$RANDOM$RANDOM}"
T0=$SECONDS
FIGURES=()

LOG_TAG="stack"
# What failed, said again after the services' logs at the end (CI shows a run's last lines).
FAILED_WITH=""
fail() { FAILED_WITH="$*"; log "FAILED: $*"; exit 1; }
# A command that fails outside fail() (a check script, under `set -e`) is named too.
set -o errtrace
trap 'FAILED_WITH="${FAILED_WITH:-line $LINENO: $BASH_COMMAND}"' ERR
figure() { FIGURES+=("$1"); log "figure: $1"; }

. scripts/prereqs.sh
. scripts/docker-lib.sh
prereqs curl:curl python3:python3

front_pid=
cleanup() {
  local rc=$?
  if [ "$rc" -ne 0 ] && [ -n "${COMPOSE_BIN:-}" ]; then
    log "logs of the stack's services (last 40 lines each):"
    compose logs --no-color --tail 40 >&2 2>&1 || true
    [ -f "$WORK/front.log" ] && tail -n 20 "$WORK/front.log" >&2
  fi
  [ "$rc" -eq 0 ] || log "FAILED (exit $rc): ${FAILED_WITH:-see above}"
  [ -n "${COMPOSE_BIN:-}" ] && { compose down -v --remove-orphans --timeout 20 >/dev/null 2>&1 || true; }
  [ -n "$front_pid" ] && kill "$front_pid" 2>/dev/null || true
  [ -n "${started_llm:-}" ] && LLM_PORT="$LLM_PORT" deploy/local-llm/llama-server.sh stop >/dev/null 2>&1 || true
  # A dockerd this script started is stopped again (its images stay in /var/lib/docker).
  docker_down
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
# -- the Docker engine -------------------------------------------------------------------------
docker_up || fail "dockerd did not start"
docker_reap sluice-stack test-stack.sh
COMPOSE_BIN=$(bash scripts/check-deploy.sh --compose-bin)
compose() {
  "$COMPOSE_BIN" --project-name "$PROJECT" --project-directory . \
    -f docker-compose.yml -f tests/stack/docker-compose.override.yml "$@"
}


# -- 1. images -------------------------------------------------------------------------------
t=$SECONDS
bash scripts/stack-images.sh all
figure "images (bases + sluice:local): $((SECONDS - t)) s"
IMAGE_BYTES=$(docker image inspect -f '{{.Size}}' sluice:local)
GZ_BYTES=$(docker save sluice:local | gzip -6 | wc -c)
figure "sluice:local: $((IMAGE_BYTES / 1048576)) MiB on disk, $((GZ_BYTES / 1048576)) MiB compressed (docker save | gzip)"

# -- the provider: the local LLM behind a scripting front on the Docker bridge's address ---------
started_llm=
if ! curl -sf -m 3 "http://127.0.0.1:$LLM_PORT/health" >/dev/null 2>&1; then
  LLM_PORT="$LLM_PORT" deploy/local-llm/llama-server.sh start
  started_llm=1
elif [ "$KEY_GIVEN" != 1 ]; then
  fail "a local LLM already serves on $LLM_PORT: export its SLUICE_LLM_API_KEY, or stop it (deploy/local-llm/llama-server.sh stop)"
fi
# The host's address on Docker's default bridge (what `host-gateway` names inside containers):
# reachable from the host and its containers only.
BRIDGE_IP=$(ip -4 -o addr show dev docker0 2>/dev/null | awk '{ split($4, a, "/"); print a[1]; exit }')
[ -n "$BRIDGE_IP" ] || fail "no IPv4 address on docker0"
STACK_LLM_PORT=$(free_port "$BRIDGE_IP")
export STACK_LLM_PORT
fake_openai=$(fake_openai_bin) || fail "no fake-openai binary"
FAKE_UPSTREAM_API_KEY="$SLUICE_LLM_API_KEY" "$fake_openai" \
  --host "$BRIDGE_IP" --port "$STACK_LLM_PORT" --upstream "http://127.0.0.1:$LLM_PORT" \
  >"$WORK/front.log" 2>&1 &
front_pid=$!
WAIT_INTERVAL=0.1 wait_until 60 "the provider front to listen" grep -q listening "$WORK/front.log" ||
  fail "the provider front did not start: $(cat "$WORK/front.log")"

# -- 2. up --------------------------------------------------------------------------------------
t=$SECONDS
compose up -d --wait --wait-timeout 300 --quiet-pull 2>"$WORK/up.log" || { cat "$WORK/up.log" >&2; fail "compose up"; }
figure "docker compose up --wait: $((SECONDS - t)) s"
port_of() { compose port "$1" "$2" | sed 's/.*://'; }
GW="127.0.0.1:$(port_of gateway 8088)"
PROM="http://127.0.0.1:$(port_of prometheus 9090)"
log "gateway http://$GW, Prometheus $PROM"

# -- 3. answers -------------------------------------------------------------------------------
invoke() { compose exec -T gateway sluice invoke "$@"; }
out=$(invoke --show-usage llm "You are a helpful, concise assistant." "Why is the sky blue? One sentence.") ||
  fail "sluice invoke llm"
[ -n "$out" ] || fail "sluice invoke llm: empty answer"
log "llm (the real local model, streamed through the gateway container): ${out:0:120}"
out=$(invoke prompt question 'question=What is the capital of France?') || fail "sluice invoke prompt"
[ -n "$out" ] || fail "sluice invoke prompt: empty answer"
log "prompt (template question): ${out:0:120}"
out=$(invoke agent -q "Please use a tool: what is two plus two?" 2>"$WORK/agent.err") ||
  { cat "$WORK/agent.err" >&2; fail "sluice invoke agent"; }
grep -q "ask-llm" "$WORK/agent.err" || fail "the agent did not call its tool: $(cat "$WORK/agent.err")"
[ -n "$out" ] || fail "sluice invoke agent: empty answer"
log "agent (one tool call, ask-llm -> the real model): ${out:0:120}"
# JSON lines: one object corrected (confidence clamped), one line skipped.
out=$(invoke prompt knowledge-classification 'blocks=[{"block_id":"b1","content":"Water boils at 100 C at sea level."}]' 2>"$WORK/jsonl.err") ||
  fail "sluice invoke prompt knowledge-classification: $(cat "$WORK/jsonl.err")"
python3 - "$out" <<'EOF' || fail "knowledge-classification: not the one corrected object for b1: $out"
import json, sys
objects = [json.loads(line) for line in sys.argv[1].splitlines() if line.strip()]
assert len(objects) == 1, f"{len(objects)} objects"
o = objects[0]
assert o["block_id"] == "b1", o
assert o["confidence"] == 1, f"the model's 1.5 was not clamped to 1: {o}"
EOF
grep -q "1 line of the model's answer skipped (1 objects printed)" "$WORK/jsonl.err" ||
  fail "knowledge-classification: the line that is not JSON was not reported skipped: $(cat "$WORK/jsonl.err")"
# Refusals and faults, each an error the caller sees (exit 1) and a series on the dashboard.
if invoke prompt no-such-template 'x=1' 2>"$WORK/err"; then fail "an unknown template was accepted"; fi
grep -qi "template" "$WORK/err" || fail "unknown template: unclear error: $(cat "$WORK/err")"
if invoke llm "s" "[fake:500] fail" 2>"$WORK/err"; then fail "a provider 500 was answered"; fi
grep -q 'llm-error' "$WORK/err" && grep -q '500' "$WORK/err" ||
  fail "a provider 500: not an llm-error naming the 500: $(cat "$WORK/err")"
status=$(curl -s -o "$WORK/429.json" -w '%{http_code}' -m 120 -H 'Content-Type: application/json' \
  -d '{"model":"smollm2","messages":[{"role":"user","content":"[fake:429] limit"}]}' \
  "http://$GW/v1/chat/completions")
[ "$status" = 429 ] || fail "OpenAI route with a provider 429: HTTP $status $(cat "$WORK/429.json")"
status=$(curl -s -o "$WORK/openai.json" -w '%{http_code}' -m 120 -H 'Content-Type: application/json' \
  -d '{"model":"smollm2","stream":true,"messages":[{"role":"user","content":"Say hello."}]}' \
  "http://$GW/v1/chat/completions")
[ "$status" = 200 ] || fail "OpenAI route stream: HTTP $status $(head -c 400 "$WORK/openai.json")"
python3 - "$WORK/openai.json" <<'EOF' || fail "OpenAI route stream: not a whole chat.completion.chunk stream"
import json, sys
data = [l[len("data: "):].strip() for l in open(sys.argv[1]) if l.startswith("data: ")]
assert data and data[-1] == "[DONE]", f"does not end with [DONE]: {data[-2:]}"
chunks = [json.loads(d) for d in data[:-1]]
assert all(c.get("object") == "chat.completion.chunk" for c in chunks), chunks[:2]
text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
assert text.strip(), "no content in the stream"
reasons = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
assert reasons.count("stop") + reasons.count("length") == 1, f"finish reasons {reasons}"
EOF
# A caller that goes away mid-stream: the gateway cancels the provider call, and the
# text-completion processor counts the request cancelled.
tc=$(compose ps -q text-completion | head -1)
cancelled() {
  docker exec "$tc" curl -sf http://127.0.0.1:8000/metrics |
    awk '/^sluice_processor_requests_total\{/ && /outcome="cancelled"/ { s += $NF } END { print s + 0 }'
}
cancelled_before=$(cancelled)
curl -s -m 2 -N -H 'Accept: application/x-ndjson' -H 'Content-Type: application/json' -d '{"system":"s","prompt":"[fake:slow] go away"}' \
  "http://$GW/api/v1/text-completion" >/dev/null || true
cancel_counted() { [ "$(cancelled)" -gt "$cancelled_before" ]; }
WAIT_INTERVAL=0.2 wait_until 60 "the processor counting a cancelled request" cancel_counted ||
  fail "a caller went away mid-stream and the processor did not cancel the request (cancelled: $(cancelled))"
log "a caller that went away cancelled its request on the processor"
# TrustGraph's own client over the gateway's WebSocket (when its venv can be made).
if tg_list=$(bash scripts/tg-cli-venv.sh 2>"$WORK/tg-venv.err"); then
  tg_bin=$(dirname "$tg_list")
  out=$("$tg_bin/tg-invoke-llm" -u "http://$GW/" "Be terse." "[fake:echo] hello over a socket") ||
    fail "tg-invoke-llm against the gateway container"
  echo "$out" | grep -q "fake reply" || fail "tg-invoke-llm: unexpected answer: $out"
  log "TrustGraph's tg-invoke-llm: ${out:0:80}"
elif [ "${CI:-}" = "true" ]; then
  fail "trustgraph-cli could not be installed; CI needs it: $(tail -n 5 "$WORK/tg-venv.err")"
else
  log "SKIPPED TrustGraph's tg-invoke-llm: trustgraph-cli could not be installed: $(tail -n 3 "$WORK/tg-venv.err")"
  if [ -n "${SLUICE_SKIP_LOG:-}" ]; then
    echo "test-stack: TrustGraph's tg-invoke-llm over the gateway container's WebSocket: skipped, trustgraph-cli could not be installed" >>"$SLUICE_SKIP_LOG"
  fi
fi

# -- 4. Prometheus --------------------------------------------------------------------------------
compose exec -T prometheus promtool check config /etc/prometheus/prometheus.yml >/dev/null ||
  fail "promtool check config"
compose exec -T prometheus promtool check rules /etc/prometheus/alerts.yml >/dev/null ||
  fail "promtool check rules"
log "promtool check config and check rules: SUCCESS"
python3 tests/stack/check_prometheus.py targets "$PROM" text-completion prompt agent gateway pulsar
python3 tests/stack/check_prometheus.py rules "$PROM" deploy/prometheus/alerts.yml --wait 30

# -- 5. three text-completion replicas ------------------------------------------------------------
t=$SECONDS
compose up -d --wait --wait-timeout 300 --scale text-completion=3 --no-recreate 2>"$WORK/up.log" ||
  { cat "$WORK/up.log" >&2; fail "compose up --scale text-completion=3"; }
figure "scale text-completion 1 -> 3 (--wait): $((SECONDS - t)) s"
mapfile -t replicas < <(compose ps -q text-completion)
[ "${#replicas[@]}" -eq 3 ] || fail "expected 3 text-completion replicas, found ${#replicas[@]}"
metric() { # metric CONTAINER NAME -> the sum of that metric's samples on the replica
  docker exec "$1" curl -sf http://127.0.0.1:8000/metrics |
    awk -v m="$2" '$1 == m || index($1, m "{") == 1 { s += $NF } END { print s + 0 }'
}
served() { metric "$1" sluice_processor_requests_total; }
declare -A before
for r in "${replicas[@]}"; do before[$r]=$(served "$r"); done
all_served() {
  local r
  for r in "${replicas[@]}"; do [ "$(served "$r")" -gt "${before[$r]}" ] || return 1; done
}
sent=0
until all_served; do
  [ "$sent" -lt 60 ] || fail "after $sent requests not every replica had served one"
  out=$(curl -sf -m 30 -H 'Accept: application/x-ndjson' -H 'Content-Type: application/json' -d "{\"system\":\"s\",\"prompt\":\"[fake:echo] $sent\"}" \
    "http://$GW/api/v1/text-completion") || fail "request $sent failed"
  echo "$out" | tail -n 1 | grep '"type":"done"' | grep -q '"reason":"success"' ||
    fail "request $sent did not end with a successful done event: $(echo "$out" | tail -n 2)"
  sent=$((sent + 1))
done
log "the load is shared: each of the 3 replicas served requests (after $sent sequential requests)"

# A replica killed mid-stream: the request goes back to the broker and another replica answers.
declare -A before_slow
for r in "${replicas[@]}"; do before_slow[$r]=$(served "$r"); done
curl -sf -m 120 -N -H 'Accept: application/x-ndjson' -H 'Content-Type: application/json' \
  -d '{"system":"s","prompt":"[fake:slow] survive a kill"}' \
  "http://$GW/api/v1/text-completion" >"$WORK/slow.ndjson" &
slow_pid=$!
# find_victim: sets $victim to a replica with a request in flight.
victim=
find_victim() {
  local r
  for r in "${replicas[@]}"; do
    if [ "$(metric "$r" sluice_processor_in_flight_requests)" -gt 0 ]; then victim=$r; return 0; fi
  done
  return 1
}
WAIT_INTERVAL=0.1 wait_until 10 "a replica taking the slow request" find_victim || fail "no replica took the slow request"
# Mid-stream: the caller has its first tokens (curl -N writes them as they arrive), and the
# rest of the answer (200 chunks, 100 ms apart) is still to come.
slow_streaming() { grep -q '"type":"token"' "$WORK/slow.ndjson"; }
WAIT_INTERVAL=0.1 wait_until 15 "the slow answer's first tokens at the caller" slow_streaming ||
  fail "the slow request streamed no token: $(tail -c 400 "$WORK/slow.ndjson")"
docker kill -s KILL "$victim" >/dev/null
log "killed replica ${victim:0:12} mid-stream"
wait "$slow_pid" || fail "the caller's request failed after the kill: $(tail -c 400 "$WORK/slow.ndjson")"
grep -q '"reason":"success"' "$WORK/slow.ndjson" || fail "no successful done event after the kill: $(tail -c 400 "$WORK/slow.ndjson")"
! grep -q '"type":"error"' "$WORK/slow.ndjson" || fail "an error event after the kill: $(grep '"type":"error"' "$WORK/slow.ndjson")"
python3 - "$WORK/slow.ndjson" <<'EOF' || fail "the answer after the kill is not whole"
import json, sys
text, restarted = "", False
for line in open(sys.argv[1]):
    event = json.loads(line)
    if event.get("type") == "status" and "restart" in json.dumps(event):
        text, restarted = "", True   # the answer starts again from its first token
    elif event.get("type") == "token":
        text += event.get("content", event.get("token", ""))
want = "".join(f"chunk {i:03}. " for i in range(200))
if not restarted:
    sys.exit("no `restarted` status: the replica was not killed mid-stream")
if text != want:
    sys.exit(f"answer differs: {text[:80]!r} ... {text[-40:]!r}")
print("[stack] the answer is whole after the kill, restarted from its first token", file=sys.stderr)
EOF
# A surviving replica answered it. (Not read from sluice_processor_redelivered_requests_total:
# Pulsar's broker does not count a redelivery caused by a consumer's death, apache/pulsar#18239.)
answered=0
for r in "${replicas[@]}"; do
  [ "$r" = "$victim" ] && continue
  answered=$((answered + $(served "$r") - ${before_slow[$r]}))
done
[ "$answered" -ge 1 ] || fail "no surviving replica finished a request after the kill"

# Dashboard: after all that traffic, every panel's every expression has data.
# Every expression returns data; evaluated on the counters behind its rates, it must show
# values that the traffic made (tests/stack/check_prometheus.py names the few that are 0 at
# rest, and why).
python3 tests/stack/check_prometheus.py panels "$PROM" deploy/grafana/dashboards/sluice.json --wait 90
python3 tests/stack/check_prometheus.py panels "$PROM" deploy/grafana/dashboards/sluice.json --wait 30 --totals
# The checks can fail: a panel on a misspelt metric, and a rule file with a broken
# expression, are each refused (their messages are shown).
sed 's/sluice_prompt_templates{/sluice_prompt_template{/' deploy/grafana/dashboards/sluice.json >"$WORK/broken-dashboard.json"
if python3 tests/stack/check_prometheus.py panels "$PROM" "$WORK/broken-dashboard.json" --wait 0 2>"$WORK/err"; then
  fail "a dashboard with a misspelt metric passed the panel check"
fi
log "a misspelt panel metric is caught: $(grep 'no data' "$WORK/err" | head -1 | sed 's/^ *//')"
# A panel on series that exist but that no traffic moved (malformed requests: none were sent).
sed 's/outcome=~\\"error|malformed\\"/outcome=\\"malformed\\"/' deploy/grafana/dashboards/sluice.json >"$WORK/zero-dashboard.json"
cmp -s deploy/grafana/dashboards/sluice.json "$WORK/zero-dashboard.json" && fail "the zero-panel edit changed nothing"
if python3 tests/stack/check_prometheus.py panels "$PROM" "$WORK/zero-dashboard.json" --wait 0 --totals 2>"$WORK/err"; then
  fail "a panel showing only series registered at 0 passed the panel check"
fi
log "a panel with no traffic behind it is caught: $(grep 'only zero' "$WORK/err" | head -1 | sed 's/^ *//' | cut -c1-160)"
sed '0,/expr: |/s//expr: |\n          sum by (job (rate(/' deploy/prometheus/alerts.yml >"$WORK/broken-alerts.yml"
docker cp "$WORK/broken-alerts.yml" "$(compose ps -q prometheus):/tmp/broken-alerts.yml"
if compose exec -T prometheus promtool check rules /tmp/broken-alerts.yml >"$WORK/err" 2>&1; then
  fail "promtool accepted a rule with a broken expression"
fi
log "a broken rule is refused by promtool: $(grep -m1 -i 'err' "$WORK/err" | sed 's/^ *//' | cut -c1-160)"

# -- start to /readyz ---------------------------------------------------------------------------
start_ns=$(date +%s%N)
cid=$(docker run -d --rm --network "${PROJECT}_default" -p 127.0.0.1::8000 --read-only --user 10001:10001 \
  sluice:local prompt --pulsar-url pulsar://pulsar:6650 --pulsar-admin-url http://pulsar:8080 \
  --metrics-addr 0.0.0.0:8000 --subscription readyz-probe)
mport=$(docker port "$cid" 8000 | head -1 | sed 's/.*://')
WAIT_INTERVAL=0.02 wait_until 60 "the container's /readyz" curl -sf -m 1 -o /dev/null "http://127.0.0.1:$mport/readyz" ||
  { docker rm -f "$cid" >/dev/null; fail "no /readyz in 60 s"; }
ready_ms=$(( ($(date +%s%N) - start_ns) / 1000000 ))
docker rm -f "$cid" >/dev/null
figure "container start to /readyz (docker run -> 200, broker up): ${ready_ms} ms"

# -- 6. down ------------------------------------------------------------------------------------
compose down -v --remove-orphans --timeout 60 >/dev/null 2>&1
left=$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT"; \
  docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT"; \
  docker network ls -q --filter "label=com.docker.compose.project=$PROJECT")
[ -z "$left" ] || fail "left behind after down -v: $left"
log "docker compose down -v: no container, volume or network left"
figure "scripts/test-stack.sh: $((SECONDS - T0)) s in all"
if [ -n "${SLUICE_STACK_FIGURES:-}" ]; then
  {
    commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
    [ -z "$(git status --porcelain --untracked-files=no -- ":/" ":(top,exclude)bench/results" 2>/dev/null)" ] || commit="$commit with uncommitted changes"
    echo "Measured $(date -u '+%Y-%m-%d %H:%M UTC') at commit $commit on this machine ($(nproc) cores) by \`bash scripts/test-stack.sh\`:"
    echo
    printf -- '- %s\n' "${FIGURES[@]}"
  } >"$SLUICE_STACK_FIGURES"
fi
log "passed"
