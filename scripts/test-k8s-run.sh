#!/usr/bin/env bash
# Runs deploy/k8s for real on a two-node Kubernetes made of upstream parts
# (deploy/k8s-local/cluster.sh: kube-apiserver, kube-controller-manager, kube-scheduler,
# kubelet, kube-proxy built from the Go module proxy; Debian's etcd, containerd, runc, CNI
# plugins), and checks what a user who applies it would meet:
#
#  1. both nodes Ready; sluice:local (scripts/stack-images.sh, the real Dockerfile) imported
#     into their containerd; a Pulsar standalone on the node bridge (10.244.0.1:6670, fresh
#     state) and the scripted provider front of the local LLM (fake-openai, tests/src/bin/fake-openai.rs,
#     10.244.0.1:8796, relaying unscripted prompts to llama-server);
#  2. the example overlay as shipped, through tests/k8s/overlay (image, broker address,
#     provider: nothing else), applied server-side; every Deployment rolls out and every pod
#     becomes Ready through its real readiness probe, with no restart; Pod Security
#     `restricted` holds on the RUNNING containers: each one's process, read from /proc on
#     the host, runs as uid 10001, with no capabilities, no_new_privs and a seccomp filter;
#  3. `sluice invoke` through the gateway's Service (its ClusterIP, routed by kube-proxy):
#     llm (the real local model), prompt (JSON lines) and agent (no tools in the shipped
#     config: the model's tool request gets an observation naming none) answer; a caller
#     without the token is refused (401);
#  4. under 64 concurrent streaming callers (tests/k8s/load.py: ~20 s text-completion
#     streams, prompt and agent requests): a rolling update of every Deployment at once (a
#     pod template change: `kubectl rollout restart`); then, under a second load, a
#     text-completion pod deleted mid-stream without grace (its requests re-delivered to the
#     other replica; KEDA keeps 2) and `kubectl drain` of the node holding most of sluice's
#     pods (the Eviction API holds to the PodDisruptionBudgets: no Deployment ever below its
#     replicas less one Ready; the pods move to the other node). Each load must end with 0
#     lost requests and 0 errors to callers; the changes' times and the longest silence
#     inside a stream are reported.
#     Then the broker SIGKILLed for 45 s: every pod leaves Ready (/readyz) and none is
#     restarted (/healthz, liveness, passes); back, every pod is Ready again, no restart.
#  5. KEDA (with CoreDNS and metrics-server, built from their Go modules and installed from
#     their own manifests: deploy/k8s-local/cluster.sh addons) and the shipped ScaledObject:
#     a backlog of 400 requests published straight to the request topic scales
#     text-completion up from its minimum of 2 through the pulsar trigger (the HPA must have
#     seen the backlog, not only CPU), the backlog drains, every request is answered on the
#     response topic, and it scales back to 2.
#  5b. the same deployment moved to TrustGraph's topic mapping (non-persistent topics, no
#     backlog) with the shipped components trustgraph-mapping and keda-in-flight: every
#     processor consumes TrustGraph's topics, the gateway answers through them, and a burst
#     of 500 requests on non-persistent://tg/request/text-completion scales text-completion
#     up through the prometheus trigger on the replicas' in-flight gauge; every request is
#     answered, and it scales back to 2.
#  6. Prometheus (Debian's, in the compose stack's image, on the host's network) configured
#     from the PodMonitor as stored in the cluster, as the Prometheus Operator would
#     (tests/k8s/podmonitor_scrape.py), through
#     Kubernetes service discovery with a ServiceAccount that may only list sluice's pods:
#     every processor's pods are targets and up, every alert rule loads.
#
# Usage: scripts/test-k8s-run.sh. Needs root, the local LLM (started when it is not serving;
# SLUICE_LLM_API_KEY must match one that is), Docker (started when none runs). Figures go to
# stdout and, when SLUICE_K8S_FIGURES names a file, there.
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$(dirname "$0")/.."
. scripts/deploy-lib.sh
. scripts/docker-lib.sh
. scripts/prereqs.sh
prereqs curl:curl python3:python3

WORK=$(mktemp -d "${TMPDIR:-/tmp}/sluice-k8s-run.XXXXXX")
NS=sluice
LLM_PORT="${LLM_PORT:-8766}"
KEY_GIVEN=0
[ -n "${SLUICE_LLM_API_KEY:-}" ] && KEY_GIVEN=1
export SLUICE_LLM_API_KEY="${SLUICE_LLM_API_KEY:-sluice-k8s-$RANDOM$RANDOM}"
export PULSAR_HOST=10.244.0.1 PULSAR_PORT=6670 PULSAR_HTTP_PORT=8096 PULSAR_BK_PORT=3196
export PULSAR_STATE_DIR="$WORK/pulsar"
SLUICE_BIN="${SLUICE_BIN:-${CARGO_TARGET_DIR:-$HOME/.cache/sluice/target}/debug/sluice}"
T0=$SECONDS
FIGURES=()
LOG_TAG="k8s-run"
fail() { log "FAILED: $*"; exit 1; }
figure() { FIGURES+=("$1"); log "figure: $1"; }

front_pid="" load_pid="" started_llm="" prom_pid="" consume_pid="" sampler_pid="" pod_logs_pid=""
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ "$rc" -ne 0 ] && [ -f "${KUBECONFIG:-}" ]; then
    log "state at the failure:"
    kubectl get pods,deployments -n "$NS" -o wide >&2 2>&1 || true
    kubectl get events -n "$NS" --sort-by .lastTimestamp 2>/dev/null | tail -n 25 >&2 || true
    # What a restarted container said before it exited.
    for pod in $(kubectl get pods -n "$NS" -o jsonpath='{range .items[?(@.status.containerStatuses[0].restartCount>0)]}{.metadata.name}{" "}{end}' 2>/dev/null); do
      log "the previous container of $pod:"
      kubectl logs -n "$NS" "$pod" --previous --tail 20 >&2 2>&1 || true
    done
    # Every pod's own words now: warnings, errors and the last lines.
    for pod in $(kubectl get pods -n "$NS" -o jsonpath='{.items[*].metadata.name}' 2>/dev/null); do
      log "$pod now (warnings, errors, last lines):"
      kubectl logs -n "$NS" "$pod" --tail 400 2>&1 | { grep -E 'WARN|ERROR|panicked' | tail -n 15; } >&2 || true
      kubectl logs -n "$NS" "$pod" --tail 5 >&2 2>&1 || true
    done
    # The pods' own words while the drain ran, kept by 4b: warnings, errors and the last lines.
    for f in "$WORK"/pod-logs/*.log; do
      [ -e "$f" ] || continue
      log "$(basename "$f" .log) (warnings, errors, last lines):"
      { grep -E 'WARN|ERROR|panicked' "$f" | tail -n 15; tail -n 5 "$f"; } >&2 || true
    done
    for c in kubelet kube-controller-manager; do
      log "last lines of $c:"; tail -n 15 "/var/lib/sluice-k8s/$c.log" >&2 2>/dev/null || true
    done
  fi
  [ -n "$load_pid" ] && kill "$load_pid" 2>/dev/null || true
  [ -n "$front_pid" ] && kill "$front_pid" 2>/dev/null || true
  [ -n "$prom_pid" ] && { docker rm -f "$prom_pid" >/dev/null 2>&1 || true; }
  [ -n "$consume_pid" ] && kill "$consume_pid" 2>/dev/null || true
  [ -n "$sampler_pid" ] && kill "$sampler_pid" 2>/dev/null || true
  [ -n "$pod_logs_pid" ] && { kill "$pod_logs_pid" 2>/dev/null; pkill -f "kubectl logs -f -n $NS" 2>/dev/null; } || true
  deploy/k8s-local/cluster.sh stop >/dev/null 2>&1 || true
  deploy/pulsar/pulsar.sh stop >/dev/null 2>&1 || true
  [ -n "$started_llm" ] && { LLM_PORT="$LLM_PORT" deploy/local-llm/llama-server.sh stop >/dev/null 2>&1 || true; }
  docker_down
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# -- 1. the node, the image, the broker, the provider -------------------------------------------
[ -x "$SLUICE_BIN" ] || fail "no sluice binary at $SLUICE_BIN (cargo build, or set SLUICE_BIN)"
docker_up || fail "dockerd did not start"   # the pause image, the sluice image
docker_reap sluice-k8s-prometheus test-k8s-run.sh
t=$SECONDS
deploy/k8s-local/cluster.sh start
eval "$(deploy/k8s-local/cluster.sh env)"
figure "two-node cluster start to both nodes Ready: $((SECONDS - t)) s (binaries cached)"
t=$SECONDS
deploy/k8s-local/cluster.sh addons
figure "CoreDNS, metrics-server and KEDA installed from their own manifests, APIs Available: $((SECONDS - t)) s (images cached)"
t=$SECONDS
bash scripts/stack-images.sh sluice >"$WORK/images.log" 2>&1 || { tail -n 30 "$WORK/images.log" >&2; fail "building sluice:local"; }
deploy/k8s-local/cluster.sh import sluice:local
figure "sluice:local built (Docker layer cache) and imported into the node's containerd: $((SECONDS - t)) s"
deploy/pulsar/pulsar.sh start
if ! curl -sf -m 3 "http://127.0.0.1:$LLM_PORT/health" >/dev/null 2>&1; then
  LLM_PORT="$LLM_PORT" deploy/local-llm/llama-server.sh start
  started_llm=1
elif [ "$KEY_GIVEN" != 1 ]; then
  fail "a local LLM already serves on $LLM_PORT: export its SLUICE_LLM_API_KEY, or stop it (deploy/local-llm/llama-server.sh stop)"
fi
fake_openai=$(fake_openai_bin) || fail "no fake-openai binary"
FAKE_UPSTREAM_API_KEY="$SLUICE_LLM_API_KEY" "$fake_openai" --host 10.244.0.1 \
  --port 8796 --upstream "http://127.0.0.1:$LLM_PORT" >"$WORK/front.log" 2>&1 &
front_pid=$!
WAIT_INTERVAL=0.1 wait_until 60 "the provider front to listen" grep -q listening "$WORK/front.log" ||
  fail "the provider front did not start: $(cat "$WORK/front.log")"

# -- 2. the example overlay, running ---------------------------------------------------------------
# KEDA's CRDs came with KEDA; the PodMonitor's (no Prometheus Operator runs here) is applied
# so that the example's PodMonitor is stored.
po=$(go_module_dir "github.com/prometheus-operator/prometheus-operator@$PROMETHEUS_OPERATOR_VERSION")
kubectl apply --server-side -f "$po/example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml" >/dev/null
kubectl wait --for condition=established --timeout 60s crd --all >/dev/null
cp -r deploy/k8s "$WORK/k8s"
cp -r tests/k8s/overlay "$WORK/k8s/overlays/test"
# The example's Secrets, from files a user would write: the gateway's token and the secret its
# replicas share are random.
umask 077
{
  openssl rand -hex 24 | sed 's/^/token=/'
  openssl rand -hex 32 | sed 's/^/secret=/'
} >"$WORK/k8s/overlays/example/gateway.env"
printf 'api-key=%s\n' "$SLUICE_LLM_API_KEY" >"$WORK/k8s/overlays/example/llm.env"
sed -n 's/^token=//p' "$WORK/k8s/overlays/example/gateway.env" >"$WORK/token"
umask 022
kubectl kustomize "$WORK/k8s/overlays/test" >"$WORK/test.yaml"
t=$SECONDS
# Warnings are errors: KEDA's admission webhook warns about ScaledObject settings that do
# nothing (it found pollingInterval and cooldownPeriod on ScaledObjects with a minimum of 2).
kubectl apply --server-side --field-manager sluice-test --validate=strict --warnings-as-errors \
  -f "$WORK/test.yaml" >/dev/null
mapfile -t deployments < <(kubectl get deployments -n "$NS" -o name)
[ "${#deployments[@]}" -eq 4 ] || fail "expected 4 Deployments, found ${#deployments[@]}: ${deployments[*]}"
for d in "${deployments[@]}"; do
  kubectl rollout status -n "$NS" "$d" --timeout 240s >/dev/null || fail "$d did not roll out"
done
figure "kubectl apply to every Deployment rolled out (pods Ready through /readyz): $((SECONDS - t)) s"
# The autoscalers then raise each Deployment to its minimum (2; the manifests leave replicas to
# them), so a rollout can finish at 1 pod and a second start right after: the pods are checked
# once every Deployment is at least at its autoscaler's minimum with all its pods Ready (CI
# failed on an agent pod 8 s old, not yet Ready, created by KEDA's HPA after the rollout).
settled() {
  kubectl get deployments,hpa -n "$NS" -o json | python3 -c 'import json, sys
items = json.load(sys.stdin)["items"]
minimum = {h["spec"]["scaleTargetRef"]["name"]: h["spec"].get("minReplicas", 1)
           for h in items if h["kind"] == "HorizontalPodAutoscaler"}
waiting = []
for d in items:
    if d["kind"] != "Deployment":
        continue
    name, want, st = d["metadata"]["name"], d["spec"].get("replicas", 1), d["status"]
    ready, have, least = st.get("readyReplicas", 0), st.get("replicas", 0), minimum.get(name, 1)
    if want < least or ready != want or have != want:
        waiting.append(f"{name}: {ready}/{have} Ready, spec {want}, minimum {least}")
if waiting:
    sys.exit("; ".join(waiting))'
}
# On a timeout, settled runs once more with its output: what is still waited for.
WAIT_INTERVAL=1 wait_until 120 "every Deployment at its autoscaler's minimum" quietly settled || settled ||
  fail "the Deployments did not settle at their autoscalers' minimums in 120 s"
figure "kubectl apply to every Deployment at its autoscaler's minimum, all pods Ready: $((SECONDS - t)) s"
kubectl get pods -n "$NS" -o json | python3 -c 'import json, sys
pods = json.load(sys.stdin)["items"]
bad = []
for p in pods:
    name = p["metadata"]["name"]
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
    restarts = sum(c.get("restartCount", 0) for c in p["status"].get("containerStatuses", []))
    if not ready or restarts:
        bad.append(f"{name}: ready={ready} restarts={restarts}")
if bad:
    sys.exit("pods not Ready or restarted: " + "; ".join(bad))
print(f"[k8s-run] {len(pods)} pods Ready, none restarted", file=sys.stderr)'

# Pod Security on the running containers: the processes themselves, as the kernel sees them.
kubectl get namespace "$NS" -o jsonpath='{.metadata.labels.pod-security\.kubernetes\.io/enforce}' |
  grep -qx restricted || fail "namespace $NS does not enforce restricted"
checked=0
for id in $(kubectl get pods -n "$NS" -o jsonpath='{range .items[*]}{range .status.containerStatuses[*]}{.containerID}{"\n"}{end}{end}' | sed 's#^containerd://##'); do
  # The task is in the containerd of the node it runs on.
  pid=$(for sock in /run/sluice-k8s/containerd*.sock; do ctr --address "$sock" -n k8s.io tasks ls 2>/dev/null; done |
    awk -v id="$id" '$1 == id { print $2 }')
  [ -n "$pid" ] || fail "container $id: no running task"
  status=$(cat "/proc/$pid/status")
  uid=$(awk '/^Uid:/ { print $2 "/" $3 "/" $4 "/" $5 }' <<<"$status")
  caps=$(awk '/^CapEff:/ { print $2 }' <<<"$status")
  nnp=$(awk '/^NoNewPrivs:/ { print $2 }' <<<"$status")
  seccomp=$(awk '/^Seccomp:/ { print $2 }' <<<"$status")
  [ "$uid" = "10001/10001/10001/10001" ] && [ "$caps" = 0000000000000000 ] && [ "$nnp" = 1 ] && [ "$seccomp" = 2 ] ||
    fail "container $id (pid $pid) is not restricted: uid $uid, CapEff $caps, NoNewPrivs $nnp, Seccomp $seccomp"
  checked=$((checked + 1))
done
log "Pod Security restricted holds on $checked running containers: uid 10001, no capabilities, no_new_privs, seccomp filter"

# -- 3. sluice invoke through the gateway's Service ---------------------------------------------------
GW="http://$(kubectl get service gateway -n "$NS" -o jsonpath='{.spec.clusterIP}'):8088"
export SLUICE_URL="$GW" SLUICE_TOKEN_FILE="$WORK/token"
out=$("$SLUICE_BIN" invoke llm "You are a helpful, concise assistant." "Why is the sky blue? One sentence.") ||
  fail "sluice invoke llm through the Service"
[ -n "$out" ] || fail "sluice invoke llm: empty answer"
log "llm (the real local model, through the gateway Service and the text-completion pod): ${out:0:100}"
out=$("$SLUICE_BIN" invoke prompt knowledge-classification 'blocks=[{"block_id":"b1","content":"Water boils at 100 C at sea level."}]' 2>"$WORK/err") ||
  fail "sluice invoke prompt: $(cat "$WORK/err")"
grep -q '"block_id":"b1"' <<<"$out" || fail "sluice invoke prompt: no object for b1: $out"
log "prompt (JSON lines, through the prompt pod): $out"
# The shipped agent.toml configures no tools: the model's request for one is answered with
# an observation naming none, and the model then answers.
out=$("$SLUICE_BIN" invoke agent -q "Please use a tool: what is two plus two?" 2>"$WORK/err") ||
  fail "sluice invoke agent: $(cat "$WORK/err")"
grep -q 'There is no tool called "ask-llm"' <<<"$out$(cat "$WORK/err")" ||
  fail "the agent did not answer the model's tool request with its (empty) tool list: $out $(cat "$WORK/err")"
log "agent (the shipped config has no tools: the model's tool request is refused, then it answers): ${out:0:100}"
status=$(curl -s -o /dev/null -w '%{http_code}' -m 10 -H 'Content-Type: application/json' -d '{"system":"s","prompt":"[fake:echo] x"}' "$GW/api/v1/text-completion")
[ "$status" = 401 ] || fail "the gateway Service answered a caller without the token: HTTP $status"

# -- Prometheus on the shipped PodMonitor ---------------------------------------------------------
# Prometheus from Debian trixie's package, in the image the compose stack runs
# (sluice-local/prometheus:debian, scripts/stack-images.sh; its build keeps the Kubernetes
# service discovery, bookworm's 2.42 left it out), on the host's network, configured from the
# PodMonitor stored in the cluster as the Prometheus Operator would
# (tests/k8s/podmonitor_scrape.py; the Operator itself is not built), discovering pods through
# the API with a ServiceAccount that may only list pods in sluice's namespace. Started here,
# checked after the changes under load below.
kubectl create namespace monitoring >/dev/null
kubectl create serviceaccount prometheus -n monitoring >/dev/null
kubectl create role prometheus-sd -n "$NS" --verb get,list,watch --resource pods >/dev/null
kubectl create rolebinding prometheus-sd -n "$NS" --role prometheus-sd --serviceaccount monitoring:prometheus >/dev/null
umask 077
kubectl create token prometheus -n monitoring --duration 2h >"$WORK/prometheus.token"
umask 022
kubectl get podmonitors -A -o json | python3 tests/k8s/podmonitor_scrape.py \
  --api-server "$(kubectl config view --minify -o jsonpath='{.clusters[0].cluster.server}')" \
  --ca-file /var/lib/sluice-k8s/pki/ca.crt --token-file "$WORK/prometheus.token" \
  --rules "$PWD/deploy/prometheus/alerts.yml" >"$WORK/prometheus.yml"
# On the node bridge's address, as the broker: KEDA's operator (a pod) reads it in 5b. The
# files the configuration names are mounted at their own paths, read-only; root in the
# container, as the token file is root's alone.
PROM_PORT=$(free_port 10.244.0.1)
bash scripts/stack-images.sh prometheus >"$WORK/images.log" 2>&1 || { tail -n 30 "$WORK/images.log" >&2; fail "making the Prometheus image"; }
prom_container="sluice-k8s-prometheus-$$"
docker run -d --name "$prom_container" --network host --user 0 \
  -v "$WORK/prometheus.yml:$WORK/prometheus.yml:ro" -v "$WORK/prometheus.token:$WORK/prometheus.token:ro" \
  -v /var/lib/sluice-k8s/pki/ca.crt:/var/lib/sluice-k8s/pki/ca.crt:ro \
  -v "$PWD/deploy/prometheus/alerts.yml:$PWD/deploy/prometheus/alerts.yml:ro" \
  sluice-local/prometheus:debian --config.file "$WORK/prometheus.yml" --storage.tsdb.path /prometheus \
  --web.listen-address "10.244.0.1:$PROM_PORT" >/dev/null
prom_pid="$prom_container"
PROM="http://10.244.0.1:$PROM_PORT"

# -- 4. changes under load -----------------------------------------------------------------------------
# load_start NAME / load_stop NAME: 64 callers through the Service around one change; the
# change must cost no request and no error.
load_start() {
  mkdir -p "$WORK/load-$1"
  python3 tests/k8s/load.py --url "$GW" --token-file "$WORK/token" --streams 64 \
    --control "$WORK/load-$1" 2>"$WORK/load-$1/log" &
  load_pid=$!
  # The change begins once every caller is in a stream (the driver says so).
  WAIT_INTERVAL=0.1 wait_ready 60 "$1: the load driver's 64 callers all streaming" "$load_pid" \
    "$WORK/load-$1/log" test -e "$WORK/load-$1/streaming" ||
    fail "$1: the 64 callers were not all streaming within 60 s (or the load driver exited)"
}
load_stop() {
  touch "$WORK/load-$1/stop"
  wait "$load_pid" || fail "$1: the load driver failed: $(tail -n 5 "$WORK/load-$1/log")"
  load_pid=""
  python3 - "$1" "$WORK/load-$1/summary.json" "$2" <<'EOF' || fail "$1: requests lost or failed (above)"
import json, sys
name, path, took = sys.argv[1], sys.argv[2], sys.argv[3]
s = json.load(open(path))
line = (f"{name}: {s['requests']} requests, {s['lost']} lost, {s['errors']} errors, "
        f"{s['restarted']} restarted and completed, longest silence in a stream "
        f"{s['longest_silence_s']} s, change took {took}")
print(f"[k8s-run] {line}", file=sys.stderr)
with open(path + ".line", "w") as f:
    f.write(line)
if s["lost"] or s["errors"] or not s["requests"]:
    for f in s["failures"]:
        print(f"  {f}", file=sys.stderr)
    sys.exit(1)
EOF
  figure "$(cat "$WORK/load-$1/summary.json.line")"
}

# Every Deployment's rolling update at once, as a release of a new version does: the gateway's
# pods drain while the processors behind them do. (One Deployment at a time, as this test
# did before, proves each of these and took four loads, ~110 s longer.)
load_start rollout
t=$SECONDS
for d in "${deployments[@]}"; do
  kubectl rollout restart -n "$NS" "$d" >/dev/null
done
for d in "${deployments[@]}"; do
  kubectl rollout status -n "$NS" "$d" --timeout 300s >/dev/null || fail "rolling update of ${d#deployment.apps/} did not finish"
done
load_stop rollout "$((SECONDS - t)) s (rollout status of all ${#deployments[@]} Deployments, restarted at once)"

# A text-completion pod deleted mid-stream, without grace: its streams must complete on the
# other replica (re-delivered by the broker, restarted from their first token). KEDA keeps
# at least minReplicaCount (2) replicas.
ready=$(kubectl get deployment text-completion -n "$NS" -o jsonpath='{.status.readyReplicas}')
[ "${ready:-0}" -ge 2 ] || fail "text-completion has ${ready:-0} Ready replicas; the ScaledObject's minimum is 2"
load_start delete-pod-and-drain
# The victim is a serving replica, not one of the rollout's old pods still draining (rollout
# status returns once the new ones are Ready; a found bug of this script: it picked a draining
# pod, which had exited by the time it was deleted).
serving() {
  kubectl get pods -n "$NS" -l app.kubernetes.io/component=text-completion \
    -o jsonpath='{range .items[?(@.status.phase=="Running")]}{.metadata.name} {.metadata.deletionTimestamp}{"\n"}{end}' |
    awk 'NF == 1 { print $1 }'
}
two_text_completion_pods() {
  [ "$(kubectl get pods -n "$NS" -l app.kubernetes.io/component=text-completion -o name | wc -l)" -eq 2 ]
}
# Not a failure by itself: the check below is whether one serves.
WAIT_INTERVAL=1 wait_until 60 "two text-completion pods" two_text_completion_pods || true
victim=$(serving | head -n 1)
[ -n "$victim" ] || fail "no serving text-completion pod to delete"
t=$SECONDS
kubectl delete pod -n "$NS" "$victim" --grace-period 0 --force >"$WORK/delete.log" 2>&1 ||
  fail "deleting $victim: $(cat "$WORK/delete.log")"
kubectl rollout status -n "$NS" deployment/text-completion --timeout 240s >/dev/null
deleted_in=$((SECONDS - t))
# The same callers go on through the drain below (one load for both changes: each load's end
# waits for its callers' ~20 s streams); what each change cost is in that load's summary,
# and the re-delivered streams show the deleted pod was mid-stream.

# -- 4b. a node drained under load --------------------------------------------------------------------
# `kubectl drain` of the node holding most of sluice's pods: it evicts them through the
# Eviction API, which refuses an eviction the PodDisruptionBudget (maxUnavailable 1) does not
# allow, so a Deployment's second pod is evicted only once the first one's replacement is
# Ready on the other node; each evicted processor drains on SIGTERM. The callers must see
# nothing but restarts; no Deployment may ever have fewer Ready pods than its replicas less 1.
drain_node=$(kubectl get pods -n "$NS" -o jsonpath='{range .items[*]}{.spec.nodeName}{"\n"}{end}' |
  sort | uniq -c | sort -rn | awk 'NR == 1 { print $2 }')
[ -n "$drain_node" ] || fail "no node holds sluice's pods"
[ "$(kubectl get nodes -o name | wc -l)" -ge 2 ] || fail "a drain needs a second node for the pods to move to"
on_node() { kubectl get pods -n "$NS" --field-selector "spec.nodeName=$1" -o name | wc -l; }
before=$(on_node "$drain_node")
# Every sluice pod's log while the drain runs (the evicted ones' are gone with them): printed
# when the script fails.
(
  mkdir -p "$WORK/pod-logs"
  while :; do
    for p in $(kubectl get pods -n "$NS" -o jsonpath='{.items[*].metadata.name}' 2>/dev/null); do
      [ -e "$WORK/pod-logs/$p.log" ] && continue
      kubectl logs -f -n "$NS" "$p" --timestamps >"$WORK/pod-logs/$p.log" 2>&1 &
    done
    sleep 1
  done
) &
pod_logs_pid=$!
# Ready pods against replicas of every Deployment, twice a second, while the drain runs.
(
  while :; do
    kubectl get deployments -n "$NS" -o jsonpath='{range .items[*]}{.metadata.name} {.spec.replicas} {.status.readyReplicas}{"\n"}{end}' 2>/dev/null
    sleep 0.5
  done
) >"$WORK/drain-ready.log" &
sampler_pid=$!
t=$SECONDS
kubectl drain "$drain_node" --ignore-daemonsets --delete-emptydir-data --timeout 300s >"$WORK/drain.log" 2>&1 ||
  { kill "$sampler_pid"; cat "$WORK/drain.log" >&2; fail "kubectl drain $drain_node did not finish"; }
drained_in=$((SECONDS - t))
for d in "${deployments[@]}"; do
  kubectl rollout status -n "$NS" "$d" --timeout 240s >/dev/null || fail "$d did not recover after the drain"
done
kill "$sampler_pid" 2>/dev/null || true
wait "$sampler_pid" 2>/dev/null || true
sampler_pid=""
load_stop delete-pod-and-drain "$deleted_in s to the deleted pod's replacement Ready, then $drained_in s (kubectl drain of $drain_node, $before sluice pods)"
restarted=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["restarted"])' "$WORK/load-delete-pod-and-drain/summary.json")
[ "$restarted" -gt 0 ] || fail "a pod deleted mid-stream restarted no request: it was not mid-stream"
[ "$(on_node "$drain_node")" = 0 ] || fail "sluice pods are still on the drained node $drain_node"
kill "$pod_logs_pid" 2>/dev/null || true
pod_logs_pid=""
pkill -f "kubectl logs -f -n $NS" 2>/dev/null || true
refused=$(grep -c "violate the pod's disruption budget" "$WORK/drain.log" || true)
python3 - "$WORK/drain-ready.log" <<'PYEOF' || fail "a Deployment lost more pods than its PodDisruptionBudget allows during the drain"
import sys
low = {}
for line in open(sys.argv[1]):
    parts = line.split()
    if len(parts) < 2:
        continue
    name, replicas = parts[0], int(parts[1])
    ready = int(parts[2]) if len(parts) > 2 and parts[2] else 0
    low[name] = min(low.get(name, (ready, replicas)), (ready, replicas), key=lambda x: x[0] - x[1])
bad = {n: v for n, v in low.items() if v[0] < v[1] - 1}
print("[k8s-run] fewest Ready during the drain: " +
      ", ".join(f"{n} {r}/{w}" for n, (r, w) in sorted(low.items())), file=sys.stderr)
sys.exit(1 if bad or not low else 0)
PYEOF
figure "drain: $before sluice pods moved off $drain_node in $drained_in s; the Eviction API refused $refused evictions for a PodDisruptionBudget; no Deployment below replicas - 1 Ready"
kubectl uncordon "$drain_node" >/dev/null

# -- 4c. the broker lost, then back: what the probes do ------------------------------------------
# As deploy/k8s documents them: /readyz fails while a pod's broker link is down, so every
# pod leaves Ready (the gateway's Service stops routing to it); /healthz, the liveness
# probe, keeps passing, so no container is restarted for an outage that is not its own. The
# broker is SIGKILLed (a crash) and kept down OUTAGE seconds, longer than liveness's 3
# failures 10 s apart would need; once it is back every pod is Ready again, still without a
# restart, and a request is answered. The startup probe: an agent pod deleted while the
# broker is down is replaced by one that starts without a broker; it waits for it (up to
# --connect-wait-secs, which the startup probe allows for), so it is neither restarted nor
# started (its /healthz is not served yet) during the outage, and is Ready once the broker is
# back. (Before this check a processor with an admin URL exited at once when the admin API
# did not answer, and the kubelet restarted it in a back-off loop.)
OUTAGE=45
restarts_of() {
  kubectl get pods -n "$NS" -o jsonpath='{range .items[*]}{range .status.containerStatuses[*]}{.restartCount}{"\n"}{end}{end}' |
    awk '{ s += $1 } END { print s + 0 }'
}
ready_pods() {
  kubectl get pods -n "$NS" -o jsonpath='{range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' |
    grep -c True || true
}
total=$(kubectl get pods -n "$NS" -o name | wc -l)
r0=$(restarts_of)
t=$SECONDS
agents_before=" $(kubectl get pods -n "$NS" -l app.kubernetes.io/component=agent -o jsonpath='{.items[*].metadata.name}') "
deploy/pulsar/pulsar.sh kill
early_victim=$(kubectl get pods -n "$NS" -l app.kubernetes.io/component=agent -o jsonpath='{.items[0].metadata.name}')
kubectl delete pod -n "$NS" "$early_victim" --wait=false >/dev/null ||
  fail "could not delete the agent pod $early_victim"
unready_at=""
while [ $((SECONDS - t)) -lt "$OUTAGE" ]; do
  if [ -z "$unready_at" ] && [ "$(ready_pods)" = 0 ]; then unready_at=$((SECONDS - t)); fi
  sleep 1
done
[ -n "$unready_at" ] ||
  fail "with the broker down $OUTAGE s, $(ready_pods) of $total pods stayed Ready: /readyz does not follow the broker"
[ "$(restarts_of)" = "$r0" ] ||
  fail "a container was restarted while the broker was down: liveness or the startup probe failed on an outage ($(restarts_of) restarts, $r0 before)"
# The agent pod that started during the outage: running, not started, never restarted.
early=$(kubectl get pods -n "$NS" -l app.kubernetes.io/component=agent \
  -o jsonpath='{range .items[*]}{.metadata.name}|{.status.containerStatuses[0].started}|{.status.containerStatuses[0].restartCount}|{.status.containerStatuses[0].state.running.startedAt}{"\n"}{end}' |
  awk -F'|' -v before="$agents_before" 'index(before, " " $1 " ") == 0')
[ "$(grep -c . <<<"$early")" = 1 ] ||
  fail "not one new agent pod in place of $early_victim during the outage: [$early] $(kubectl get pods -n "$NS" -o wide)"
IFS='|' read -r early_name early_started early_restarts early_running <<<"$early"
[ -n "$early_running" ] && [ "$early_started" = false ] && [ "$early_restarts" = 0 ] ||
  fail "the agent pod $early_name, started during the outage: running since '${early_running}', started=$early_started, restarts=$early_restarts (it should run, waiting for the broker, with the startup probe holding)"
deploy/pulsar/pulsar.sh start
t=$SECONDS
# At least as many as before: the autoscalers may have added pods meanwhile.
all_ready_again() { [ "$(ready_pods)" -ge "$total" ]; }
WAIT_INTERVAL=1 wait_until 180 "every pod Ready after the broker came back" all_ready_again ||
  fail "180 s after the broker came back only $(ready_pods) of $total pods are Ready"
back_at=$((SECONDS - t))
[ "$(restarts_of)" = "$r0" ] || fail "a container was restarted across the broker's outage"
out=$("$SLUICE_BIN" invoke llm "Be terse." "[fake:echo] after the outage") || fail "sluice invoke after the broker's outage"
grep -q 'after the outage' <<<"$out" || fail "sluice invoke after the broker's outage: $out"
figure "broker SIGKILLed: all $total pods NotReady (/readyz) in ${unready_at} s, none restarted in ${OUTAGE} s down, an agent pod started during the outage waited (not started, 0 restarts); broker back: all Ready again in ${back_at} s, none restarted, requests answered"

# -- 5. KEDA scales text-completion on the request topic's backlog ------------------------------------
for so in text-completion prompt agent; do
  kubectl wait -n "$NS" "scaledobject/$so" --for condition=Ready --timeout 120s >/dev/null ||
    fail "the ScaledObject $so is not Ready: $(kubectl get scaledobject "$so" -n "$NS" -o jsonpath='{.status.conditions}')"
  min=$(kubectl get hpa "keda-hpa-$so" -n "$NS" -o jsonpath='{.spec.minReplicas}')
  [ "$min" = 2 ] || fail "KEDA's HPA for $so has minReplicas ${min:-none}, not the ScaledObject's 2"
done
# The shipped ScaledObject: a pulsar trigger on the subscription's backlog, 100 per replica,
# minimum 2 (the test overlay shortens only the scale-down stabilization, 300 s to 20 s). A
# backlog: BACKLOG requests published at once straight to the request topic, as a batch
# producer would, each a 30 s stream ("[fake:hold]"). Two replicas take them all in (256
# each), but a request counts in the backlog until its terminal record is acknowledged, so
# KEDA sees BACKLOG for 30 s and wants BACKLOG/100 replicas.
BACKLOG=400
replicas() { kubectl get deployment text-completion -n "$NS" -o jsonpath='{.spec.replicas} {.status.readyReplicas}'; }
# at_minimum BEFORE: text-completion back at its minimum of 2 (the load before may have scaled
# it on CPU, the second trigger), waited for up to 180 s.
at_two_replicas() { local spec; read -r spec _ <<<"$(replicas)"; [ "$spec" -eq 2 ]; }
at_minimum() {
  WAIT_INTERVAL=2 wait_until 180 "text-completion at its minimum of 2 replicas" at_two_replicas ||
    fail "text-completion is at $(replicas) replicas (spec, ready) before $1, not its minimum 2"
}
at_minimum "the backlog"
# The backlog per replica as the HPA KEDA made sees it: the external metric, read through
# KEDA's metrics API server (which asks its operator by the Service's DNS name).
external_metric() {
  kubectl get hpa keda-hpa-text-completion -n "$NS" \
    -o jsonpath='{.status.currentMetrics[?(@.type=="External")].external.current.averageValue}' |
    awk '/m$/ { sub(/m$/, ""); print $1 / 1000; next } { print $1 + 0 }'
}
backlog_of() {
  curl -sf -m 5 "http://$PULSAR_HOST:$PULSAR_HTTP_PORT/admin/v2/persistent/tg/request/text-completion/stats" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["subscriptions"]["text-completion"]["msgBacklog"])'
}
pulsar_dist=$(deploy/pulsar/pulsar.sh dist)
pulsar_java=$(deploy/pulsar/pulsar.sh java)
# answers_start TOPIC: every answer is read back from the response topic by a subscription
# of its own, made before the requests are published (on a non-persistent topic a record
# reaches only the subscriptions that exist when it is published).
answers_start() {
  local kind=${1%%://*} path=${1#*://}
  JAVA_HOME="$pulsar_java" "$pulsar_dist/bin/pulsar-client" --url "pulsar://$PULSAR_HOST:$PULSAR_PORT" \
    consume "$1" -s k8s-answers-check -n 0 >"$WORK/responses.log" 2>&1 &
  consume_pid=$!
  WAIT_INTERVAL=0.3 wait_until 30 "the answers' subscription on $1" answers_subscribed "$kind/$path" ||
    fail "the answers' subscription on $1 was not made within 30 s"
}
# answers_subscribed KIND/PATH: the topic's stats list answers_start's subscription.
answers_subscribed() {
  curl -sf -m 5 "http://$PULSAR_HOST:$PULSAR_HTTP_PORT/admin/v2/$1/stats" | grep -q '"k8s-answers-check"'
}
# answers_check N: the subscription saw N ends of stream and no error record.
answers_check() {
  kill "$consume_pid" 2>/dev/null || true
  wait "$consume_pid" 2>/dev/null || true
  consume_pid=""
  python3 - "$WORK/responses.log" "$1" <<'PYEOF' || fail "the answers (above)"
# Each record's attempt (sluice-attempt: one per handling of a request) and index within it
# (sluice-seq), from pulsar-client's "properties:[k=v, ...], content:{...}" lines: every
# request must be answered by exactly one attempt, its records 0..n once each, ending with
# end_of_stream and no error (sync messages skipped). No fault is injected here, so an attempt that never ends (a
# request handled twice) or a record received twice is a finding too.
import json, re, sys
from collections import defaultdict
attempts = defaultdict(lambda: {"seqs": [], "end": False})
errors = records = others = 0
for line in open(sys.argv[1], errors="replace"):
    i = line.find("content:")
    if i < 0:
        continue
    props = dict(re.findall(r"([\w.-]+)=([^,\]]*)", line[line.find("properties:["):i]))
    # A processor's sync messages on a non-persistent topic (sluice-sync, payload {}), not
    # answers: they let clients see dropped records (schema/src/properties.rs).
    if "sluice-sync" in props:
        continue
    # Answers to other requests on the same response topic (the callers of the sections
    # before, still streaming on the durable topic when the subscription is made, records
    # from the middle of their attempts): not this burst's, whose requests all carry
    # id=k8s-burst (publish), copied onto every record of their answers.
    if props.get("id") != "k8s-burst":
        others += 1
        continue
    records += 1
    a = attempts[props.get("sluice-attempt", "?")]
    a["seqs"].append(props.get("sluice-seq", "?"))
    r = json.loads(line[i + len("content:"):])
    if r.get("error"):
        errors += 1
        if errors <= 3:
            print(f"  an error record: {r['error']}", file=sys.stderr)
    if r.get("end_of_stream"):
        a["end"] = True
want = int(sys.argv[2])
ended = sum(1 for a in attempts.values() if a["end"])
unended = [k for k, a in attempts.items() if not a["end"]]
twice = sum(len(a["seqs"]) - len(set(a["seqs"])) for a in attempts.values())
gaps = [k for k, a in attempts.items()
        if sorted(int(x) for x in set(a["seqs"]) if x.isdigit()) != list(range(len(set(a["seqs"]))))]
print(f"[k8s-run] the answers: {records} records, {len(attempts)} attempts, {ended} ended of "
      f"{want} requests, {len(unended)} never ended, {twice} records received twice, "
      f"{len(gaps)} attempts with a gap in sluice-seq, {errors} errors ({others} records of "
      f"other requests skipped)", file=sys.stderr)
for k in unended[:3]:
    print(f"  never ended: attempt {k}: sluice-seq {attempts[k]['seqs']}", file=sys.stderr)
sys.exit(0 if ended == want and not unended and not twice and not gaps and errors == 0 else 1)
PYEOF
}
# publish TOPIC N: N requests at once straight to the request topic, as a batch producer
# would, each a 30 s stream ("[fake:hold]"). -f, not -m: pulsar-client splits -m at commas.
publish() {
  printf '%s' '{"system":"Be terse.","prompt":"[fake:hold] a request of the burst","streaming":true}' >"$WORK/burst.json"
  JAVA_HOME="$pulsar_java" "$pulsar_dist/bin/pulsar-client" --url "pulsar://$PULSAR_HOST:$PULSAR_PORT" \
    produce "$1" -n "$2" -r 0 -p id=k8s-burst -f "$WORK/burst.json" >"$WORK/produce.log" 2>&1 ||
    { tail -n 20 "$WORK/produce.log" >&2; fail "publishing $2 requests to $1"; }
}
# scale_up WHAT THRESHOLD: within 180 s of `t` a third text-completion pod is Ready, and the
# HPA KEDA made saw its trigger's metric above THRESHOLD per replica (so the trigger under
# test scaled it, not the CPU one). Sets up_at, seen and most.
scale_up() {
  up_at="" most=2 seen=0
  local deadline=$((SECONDS + 180)) spec ready m
  while [ "$SECONDS" -lt "$deadline" ]; do
    read -r spec ready <<<"$(replicas)"
    [ "${spec:-0}" -gt "$most" ] && most=$spec
    m=$(external_metric)
    awk -v m="${m:-0}" -v s="$seen" 'BEGIN { exit !(m > s) }' && seen=$m
    if [ "${ready:-0}" -gt 2 ]; then up_at=$((SECONDS - t)); break; fi
    sleep 1
  done
  [ -n "$up_at" ] || fail "KEDA did not scale text-completion up within 180 s of $1 (replicas: $(replicas); HPA: $(kubectl get hpa -n "$NS" keda-hpa-text-completion -o jsonpath='{.status}'))"
  awk -v m="$seen" -v th="$2" 'BEGIN { exit !(m > th) }' ||
    fail "text-completion scaled up, but the HPA never saw its trigger above $2 per replica (most: $seen): not that trigger"
}
# scale_down SINCE: back to the minimum of 2 within 240 s; sets down_at (seconds since `t`).
scale_down() {
  WAIT_INTERVAL=2 wait_until 240 "text-completion back at 2 replicas" at_two_replicas ||
    fail "KEDA did not scale text-completion back to 2 within 240 s of $1 (replicas $(replicas))"
  down_at=$((SECONDS - t))
}
answers_start persistent://tg/response/text-completion
t=$SECONDS
publish persistent://tg/request/text-completion "$BACKLOG"
log "published $BACKLOG requests in $((SECONDS - t)) s; backlog $(backlog_of)"
scale_up "a backlog of $BACKLOG" 100
figure "KEDA: a backlog of $BACKLOG requests -> a third text-completion pod Ready in ${up_at} s (the HPA saw $seen per replica)"
drained_at="" deadline=$((SECONDS + 240))
while [ "$SECONDS" -lt "$deadline" ]; do
  read -r spec ready <<<"$(replicas)"
  [ "${spec:-0}" -gt "$most" ] && most=$spec
  [ "$(backlog_of)" = 0 ] && { drained_at=$((SECONDS - t)); break; }
  sleep 2
done
[ -n "$drained_at" ] || fail "the backlog did not drain within 240 s (left: $(backlog_of); replicas $(replicas))"
scale_down "the drained backlog"
figure "KEDA: backlog drained ${drained_at} s after publishing (up to $most replicas); back to the minimum of 2 $((down_at - drained_at)) s later"
answers_check "$BACKLOG"

# -- 5b. TrustGraph's mapping: KEDA on the requests in flight -------------------------------------------
# The same deployment moved to TrustGraph's topic mapping (non-persistent request and
# response topics, which keep no backlog: the pulsar trigger reads 0 there) with the shipped
# components trustgraph-mapping and keda-in-flight (the trigger: the replicas' own gauge
# sluice_processor_in_flight_requests, summed by the Prometheus above, 192 per replica),
# through tests/k8s/overlay-trustgraph (the test overlay plus those components; only the
# Prometheus address changed). A burst of BURST requests published at once to
# non-persistent://tg/request/text-completion, each a 30 s stream: the two replicas take them
# all (each keeps 1,000 flow permits on a non-persistent topic, so the broker drops none) and
# handle up to 256 at once, so the sum is BURST and KEDA wants BURST/192 replicas.
BURST=500
cp -r tests/k8s/overlay-trustgraph "$WORK/k8s/overlays/test-trustgraph"
sed -i "s|PROMETHEUS_URL|$PROM|" "$WORK/k8s/overlays/test-trustgraph/kustomization.yaml"
kubectl kustomize "$WORK/k8s/overlays/test-trustgraph" >"$WORK/test-trustgraph.yaml"
t=$SECONDS
kubectl apply --server-side --field-manager sluice-test --validate=strict --warnings-as-errors \
  -f "$WORK/test-trustgraph.yaml" >/dev/null
for d in "${deployments[@]}"; do
  kubectl rollout status -n "$NS" "$d" --timeout 240s >/dev/null || fail "$d did not roll out on TrustGraph's mapping"
done
log "every Deployment rolled out on TrustGraph's mapping in $((SECONDS - t)) s"
# A change of topic mapping is a migration, not a change a rolling update hides: until the
# old pods are gone, an old gateway still takes requests on the old (durable) topics, where
# no processor listens any more, and ends them with an error when its drain ends ("the
# gateway is shutting down", seen twice when the request below met one). Wait for them.
# none_terminating: sets $terminating to the names of the pods still terminating.
none_terminating() {
  terminating=$(kubectl get pods -n "$NS" -o jsonpath='{.items[?(@.metadata.deletionTimestamp)].metadata.name}')
  [ -z "$terminating" ]
}
WAIT_INTERVAL=1 wait_until 120 "the durable mapping's pods gone" none_terminating || fail "pods of the durable mapping still terminating 120 s after the rollout: $terminating"
log "the durable mapping's pods are gone $((SECONDS - t)) s after the change"
# The processors consume TrustGraph's topics now, and the gateway answers through them.
tg_consumers() {
  curl -sf -m 5 "http://$PULSAR_HOST:$PULSAR_HTTP_PORT/admin/v2/non-persistent/tg/request/text-completion/stats" |
    python3 -c 'import json, sys; print(len(json.load(sys.stdin)["subscriptions"]["text-completion"]["consumers"]))' 2>/dev/null
}
two_tg_consumers() { [ "$(tg_consumers)" = 2 ]; }
WAIT_INTERVAL=1 wait_until 60 "2 consumers of non-persistent://tg/request/text-completion" two_tg_consumers ||
  fail "text-completion's 2 replicas do not consume non-persistent://tg/request/text-completion (consumers: $(tg_consumers))"
out=$("$SLUICE_BIN" invoke llm "Be terse." "[fake:echo] on TrustGraph's topics") ||
  fail "sluice invoke through the gateway on TrustGraph's mapping"
grep -q "on TrustGraph's topics" <<<"$out" || fail "sluice invoke on TrustGraph's mapping: $out"
# KEDA reads the trigger from Prometheus before anything is asked of it (0 in flight): the
# HPA has the external metric.
has_external_metric() { [ -n "$(external_metric)" ]; }
WAIT_INTERVAL=2 wait_until 180 "the in-flight metric from KEDA on the HPA" has_external_metric ||
  fail "the HPA has no in-flight metric from KEDA's prometheus trigger within 180 s: $(kubectl get hpa -n "$NS" keda-hpa-text-completion -o jsonpath='{.status.conditions}')"
at_minimum "the burst"
answers_start non-persistent://tg/response/text-completion
t=$SECONDS
publish non-persistent://tg/request/text-completion "$BURST"
scale_up "a burst of $BURST requests on a non-persistent topic" 192
figure "KEDA on TrustGraph's mapping (non-persistent topics, prometheus trigger on the in-flight gauge): a burst of $BURST requests -> a third text-completion pod Ready in ${up_at} s (the HPA saw $seen in flight per replica)"
# Every request of the burst is answered (30 s each), then the replicas go back to 2.
burst_answered() { [ "$(grep -c '"end_of_stream":true' "$WORK/responses.log")" -ge "$BURST" ]; }
WAIT_INTERVAL=2 wait_until 240 "every request of the burst answered" burst_answered || fail "the burst was not answered within 240 s ($(grep -c '"end_of_stream":true' "$WORK/responses.log") ends of $BURST)"
answered_at=$((SECONDS - t))
scale_down "the answered burst"
figure "KEDA on TrustGraph's mapping: the burst answered ${answered_at} s after publishing (up to $most replicas); back to the minimum of 2 $((down_at - answered_at)) s later"
answers_check "$BURST"

# -- 6. what Prometheus scraped through the PodMonitor ---------------------------------------------------
python3 tests/stack/check_prometheus.py targets "$PROM" text-completion prompt agent gateway --wait 60 ||
  fail "Prometheus (PodMonitor translation) does not scrape every processor's pods: $(docker logs --tail 5 "$prom_pid" 2>&1)"
python3 tests/stack/check_prometheus.py rules "$PROM" deploy/prometheus/alerts.yml --wait 30 ||
  fail "the alert rules did not load"
# Not the dashboard's panels: here the broker is not scraped, no 429 is provoked and the
# shipped agent has no tools, so six panels rightly have no data; the compose stack test
# (scripts/test-stack.sh) checks every panel with traffic behind it.
n=$(python3 tests/stack/check_prometheus.py query "$PROM" 'count(up{namespace="sluice"} == 1)' |
  python3 -c 'import json, sys; r = json.load(sys.stdin); print(r[0]["value"][1] if r else 0)')
figure "Prometheus through the shipped PodMonitor: $n pod targets up, every alert rule loaded"

figure "scripts/test-k8s-run.sh: $((SECONDS - T0)) s in all"
echo "== test-k8s-run: passed"
printf '  %s\n' "${FIGURES[@]}"
if [ -n "${SLUICE_K8S_FIGURES:-}" ]; then
  {
    commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
    [ -z "$(git status --porcelain --untracked-files=no -- ":/" ":(top,exclude)bench/results" 2>/dev/null)" ] || commit="$commit with uncommitted changes"
    echo "Measured $(date -u '+%Y-%m-%d %H:%M UTC') at commit $commit on this machine ($(nproc) cores) by \`bash scripts/test-k8s-run.sh\`:"
    echo
    printf -- '- %s\n' "${FIGURES[@]}"
  } >"$SLUICE_K8S_FIGURES"
fi
