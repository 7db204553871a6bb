#!/usr/bin/env bash
# Brings up TrustGraph's own processes (trustgraph-flow 2.11.1, unmodified; venv from
# scripts/tg-flow-venv.sh) on a running Pulsar broker, and stops them again.
#
#   tests/py/tg/up.sh start     start every process, waiting for each one's readiness signal
#   tests/py/tg/up.sh stop      stop every process this script started (by recorded pid)
#
# What runs (each: one command line, its log in $TG_RUN_DIR/<name>.log, its pid in
# $TG_RUN_DIR/<name>.pid):
#   bootstrap        TrustGraph's bootstrapper: Pulsar tenant `tg` and namespaces, then the
#                    seed (tests/py/tg/seed.json) into `__template__`, workspace `default`
#                    through IAM, and flow `default` of blueprint `sluice-min`
#   config-svc       tests/py/tg_config_svc.py (TrustGraph's config service, in-memory store)
#   no-auth-svc      TrustGraph's IAM that allows everything (api-gateway requires an IAM),
#                    through tests/py/tg_noauth_svc.py: unmodified but for a signing key
#   flow-svc         TrustGraph's flow service (start-flow writes processor:<id> config)
#   api-gateway      TrustGraph's HTTP gateway, used by tg-invoke-llm/-prompt/-agent
#   text-completion  text-completion-openai  --id text-completion  (TG_PROCESSORS)
#   prompt           prompt-template         --id prompt           (TG_PROCESSORS)
#   agent-manager    agent-manager-react     --id agent-manager    (TG_PROCESSORS)
#   fake-openai      fake-openai (tests/src/bin/fake-openai.rs), unless OPENAI_BASE_URL is set
#
# Settings (environment):
#   PULSAR_URL (pulsar://127.0.0.1:6650), PULSAR_ADMIN_URL (http://127.0.0.1:8080)
#   TG_FLOW_VENV     the venv (default: built or reused by scripts/tg-flow-venv.sh)
#   TG_RUN_DIR       logs and pids (default /tmp/sluice-tg-run)
#   TG_GATEWAY_PORT  api-gateway's HTTP port (default 8888, the CLI's default)
#   TG_METRICS_BASE  Prometheus ports: every TrustGraph process serves one (default 8000,
#                    which would collide); process i gets TG_METRICS_BASE+i (default 8100)
#   TG_PROCESSORS    which flow processors to run from TrustGraph (default
#                    "text-completion prompt agent-manager"; leave one out to put a sluice
#                    processor in its place)
#   OPENAI_BASE_URL  an OpenAI-compatible endpoint for text-completion-openai; its key, if
#                    any, in OPENAI_TOKEN (read from the environment by TrustGraph). Unset:
#                    the fake server runs on FAKE_OPENAI_PORT (default 8767).
#   TG_MODEL         model name sent upstream when the flow gives none (default fake-model)
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/../../../scripts/lib.sh"

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
PULSAR_URL="${PULSAR_URL:-pulsar://127.0.0.1:6650}"
PULSAR_ADMIN_URL="${PULSAR_ADMIN_URL:-http://127.0.0.1:8080}"
RUN="${TG_RUN_DIR:-/tmp/sluice-tg-run}"
GW_PORT="${TG_GATEWAY_PORT:-8888}"
MBASE="${TG_METRICS_BASE:-8100}"
PROCESSORS="${TG_PROCESSORS:-text-completion prompt agent-manager}"
FAKE_PORT="${FAKE_OPENAI_PORT:-8767}"
MODEL="${TG_MODEL:-fake-model}"
READY_TIMEOUT="${TG_READY_TIMEOUT:-180}"

LOG_TAG="tg-up"

# Common flags of every TrustGraph processor: the broker, its admin API, no Loki log
# shipping (on by default, to http://loki:3100), and a metrics port of its own.
common() {
  printf '%s\n' -p "$PULSAR_URL" --pulsar-admin-url "$PULSAR_ADMIN_URL" --no-loki-enabled \
    -P "$((MBASE + $1))"
}

launch() { # name, command...
  local name="$1"; shift
  log "starting $name: $*"
  ( cd "$repo" && exec "$@" ) > "$RUN/$name.log" 2>&1 &
  echo $! > "$RUN/$name.pid"
}

wait_log() { # name, fixed string that marks readiness
  local name="$1" pattern="$2" t0=$SECONDS
  WAIT_INTERVAL=1 wait_ready "$READY_TIMEOUT" "$name (waiting for: $pattern)" "$(cat "$RUN/$name.pid")" \
    "$RUN/$name.log" grep -sqF -- "$pattern" "$RUN/$name.log" || return 1
  log "$name ready ($((SECONDS - t0))s): $pattern"
}

start() {
  mkdir -p "$RUN"
  local venv="${TG_FLOW_VENV:-}"
  [ -n "$venv" ] || venv=$(bash "$repo/scripts/tg-flow-venv.sh")
  local bin="$venv/bin"

  # Bootstrap initialisers, TrustGraph's own classes: the order is the order they run in.
  cat > "$RUN/initialisers.json" <<EOF
{"initialisers": [
  {"class": "trustgraph.bootstrap.initialisers.PulsarTopology", "name": "pulsar-topology",
   "flag": "v1", "params": {"admin_url": "$PULSAR_ADMIN_URL", "tenant": "tg"}},
  {"class": "trustgraph.bootstrap.initialisers.TemplateSeed", "name": "template-seed",
   "flag": "v1", "params": {"config_file": "$here/seed.json"}},
  {"class": "trustgraph.bootstrap.initialisers.WorkspaceInit", "name": "workspace-init",
   "flag": "v1", "params": {"workspace": "default", "source": "template"}},
  {"class": "trustgraph.bootstrap.initialisers.DefaultFlowStart", "name": "default-flow",
   "flag": "v1", "params": {"workspace": "default", "flow_id": "default",
                            "blueprint": "sluice-min", "description": "sluice issue 14"}}
]}
EOF

  if [ -z "${OPENAI_BASE_URL:-}" ]; then
    fake_openai=$(fake_openai_bin) || fail "no fake-openai binary"
    launch fake-openai "$fake_openai" --port "$FAKE_PORT"
    wait_log fake-openai "fake-openai listening"
    export OPENAI_BASE_URL="http://127.0.0.1:$FAKE_PORT/v1"
  fi

  # The bootstrapper's pre-service step creates tenant tg and its namespaces (flow,
  # request, response, notify); nothing else can subscribe before that.
  mapfile -t c < <(common 0)
  launch bootstrap "$bin/bootstrap" "${c[@]}" -c "$RUN/initialisers.json"
  wait_log bootstrap "Pre-service initialiser completed"

  mapfile -t c < <(common 1)
  launch config-svc "$bin/python" "$repo/tests/py/tg_config_svc.py" "${c[@]}"
  wait_log config-svc "Pushed config poke version"

  mapfile -t c < <(common 2)
  launch no-auth-svc "$bin/python" "$repo/tests/py/tg_noauth_svc.py" "${c[@]}"
  wait_log no-auth-svc "Applied startup config version"

  mapfile -t c < <(common 3)
  launch flow-svc "$bin/flow-svc" "${c[@]}"
  wait_log flow-svc "Applied startup config version"

  # The gateway asks IAM for a JWT signing key (30 times, 2 s apart) before it listens:
  # tests/py/tg_noauth_svc.py answers with one, so it listens at once, instead of after
  # ~60 s as under no-auth-svc's empty key. Started now, waited for last.
  mapfile -t c < <(common 7)
  launch api-gateway "$bin/api-gateway" "${c[@]}" --port "$GW_PORT"

  local i=4 p
  for p in $PROCESSORS; do
    mapfile -t c < <(common "$i")
    case "$p" in
      text-completion)
        launch text-completion "$bin/text-completion-openai" "${c[@]}" --id text-completion \
          -u "$OPENAI_BASE_URL" -m "$MODEL" ;;
      prompt) launch prompt "$bin/prompt-template" "${c[@]}" --id prompt ;;
      # The agent saves each thought, observation and answer to the librarian (for
      # explainability) and waits for its reply: 120 s by default. No librarian runs here,
      # so each save fails after --librarian-timeout seconds and the agent carries on.
      agent-manager)
        launch agent-manager "$bin/agent-manager-react" "${c[@]}" --id agent-manager \
          --librarian-timeout "${TG_LIBRARIAN_TIMEOUT:-1}" ;;
      *) log "unknown processor $p"; return 1 ;;
    esac
    i=$((i + 1))
  done

  # The flow exists once the bootstrapper's last initialiser has completed; each flow
  # processor is serving once it has started its consumers for flow default/default.
  wait_log bootstrap "Flow 'default' started"
  for p in $PROCESSORS; do wait_log "$p" "Started flow: default/default"; done

  # api-gateway (started above) knows the flow once it logs this.
  wait_log api-gateway "Starting flow default/default"
  WAIT_INTERVAL=1 wait_until "$READY_TIMEOUT" "api-gateway to listen on $GW_PORT" \
    curl -s -o /dev/null "http://127.0.0.1:$GW_PORT/" ||
    { log "api-gateway not listening"; return 1; }
  log "api-gateway listening on http://127.0.0.1:$GW_PORT/"
}

stop() {
  local f pid
  for f in "$RUN"/*.pid; do
    [ -e "$f" ] || continue
    pid=$(cat "$f")
    if kill -0 "$pid" 2>/dev/null; then
      kill "$pid" 2>/dev/null || true
      wait_gone 10 "$(basename "$f" .pid) (pid $pid) to exit" "$pid" || true
      kill -9 "$pid" 2>/dev/null || true
      log "stopped $(basename "$f" .pid)"
    fi
    rm -f "$f"
  done
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
