#!/usr/bin/env bash
# Applies sluice's Kubernetes manifests to a real API server on this machine:
#
#  - etcd from Debian's etcd-server, and kube-apiserver at the version the manifests are
#    checked against (scripts/deploy-lib.sh: 1.32.0), built from the Go module proxy once
#    and cached under ~/.cache/sluice/k8s (no release binaries can be downloaded here);
#  - both on loopback, on free ports the kernel hands out (so that runs can overlap), with
#    their state, certificates and keys (openssl) in a temporary directory removed on exit;
#    the admin's token is in a file the kubeconfig names, never in argv;
#  - the KEDA ScaledObject and Prometheus Operator PodMonitor CRDs from those projects' Go
#    modules, established;
#  - the base and every overlay under deploy/k8s/overlays (rendered from a copy in which the
#    *.env.example files stand in for the uncommitted *.env), each into a namespace emptied
#    of the previous one's objects, applied for real with `kubectl apply --server-side
#    --validate=strict --warnings-as-errors` (a Pod Security warning on a Deployment fails
#    it); every object is then read back;
#  - a Pod from every Deployment's template, created with --dry-run=server in its namespace,
#    so that Pod Security admission ENFORCES the namespace's `restricted` level: it only
#    warns on Deployments, and no kube-controller-manager runs here to make the Pods (one
#    would only report a refused Pod as a ReplicaSet event; the dry run is the same
#    admission, answered to the caller);
#  - broken manifests, each on its own, each refused by the server with its message shown:
#    a pod template allowing privilege escalation and one without runAsNonRoot (Pod
#    Security), a misspelt field (strict validation) and a ScaledObject without
#    scaleTargetRef (the CRD's schema). Any of them accepted fails the test.
#
# Usage: scripts/test-k8s.sh. Exits non-zero on any failure; prints a summary (objects per
# kustomization, the refusals, timings). Needs go, python3, openssl, etcd (installed when
# missing) and kubectl. SLUICE_CACHE moves the cache (default ~/.cache/sluice). The first run builds kube-apiserver (minutes; Go's build cache helps
# later builds), later runs take seconds.
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$(dirname "$0")/.."
. scripts/deploy-lib.sh           # KUBERNETES_VERSION, KEDA_VERSION, ..., go_module_dir, k8s_binary
. scripts/prereqs.sh
prereqs go:golang-go python3:python3 openssl:openssl etcd:etcd-server
command -v kubectl >/dev/null 2>&1 || { echo "kubectl is needed" >&2; exit 1; }

CACHE="${SLUICE_CACHE:-$HOME/.cache/sluice}/k8s"
APISERVER="$CACHE/bin/kube-apiserver-v$KUBERNETES_VERSION"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/sluice-k8s.XXXXXX")
T0=$SECONDS
LOG_TAG="k8s"
fail() { log "FAILED: $*"; exit 1; }
now_ms() { date +%s%3N; }
secs() { awk -v ms="$1" 'BEGIN { printf "%.1f s", ms / 1000 }'; }

pids=()
cleanup() {
  local rc=$? p
  trap - EXIT INT TERM
  if [ "$rc" -ne 0 ]; then
    for f in "$WORK"/etcd.log "$WORK"/apiserver.log; do
      [ -f "$f" ] && { log "last lines of $(basename "$f"):"; tail -n 25 "$f" >&2; }
    done
  fi
  # Their state is thrown away: no need to wait out kube-apiserver's graceful shutdown.
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# -- kube-apiserver from the Go module proxy (scripts/deploy-lib.sh: k8s_binary) ----------------
build="cached"
if [ ! -x "$APISERVER" ]; then
  log "building kube-apiserver v$KUBERNETES_VERSION from the Go module proxy (once; cached)"
  t=$(now_ms)
  k8s_binary kube-apiserver >/dev/null || fail "building kube-apiserver"
  build="built in $(secs $(($(now_ms) - t)))"
  log "kube-apiserver $build"
fi
[ "$("$APISERVER" --version)" = "Kubernetes v$KUBERNETES_VERSION" ] ||
  fail "$APISERVER is not v$KUBERNETES_VERSION"

# -- etcd ---------------------------------------------------------------------------------------
etcd_port=$(free_port)
peer_port=$(free_port)
etcd --name sluice-test --data-dir "$WORK/etcd" \
  --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
  --listen-peer-urls "http://127.0.0.1:$peer_port" --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
  --initial-cluster "sluice-test=http://127.0.0.1:$peer_port" >"$WORK/etcd.log" 2>&1 &
pids+=($!)
etcd_version=$(etcd --version | awk '/etcd Version/ {print $3}')

# -- certificates, the service-account key, the admin's token -----------------------------------
(
  cd "$WORK"
  umask 077
  openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj "/CN=sluice-test-ca" \
    -keyout ca.key -out ca.crt 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj "/CN=kube-apiserver" -keyout apiserver.key \
    -out apiserver.csr 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' >san.ext
  openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 \
    -extfile san.ext -out apiserver.crt 2>/dev/null
  openssl genrsa -out sa.key 2048 2>/dev/null
  openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
  python3 -c 'import secrets; print(secrets.token_hex(24))' >token
  printf '%s,admin,admin,system:masters\n' "$(cat token)" >tokens.csv   # printf: a builtin
)

# -- kube-apiserver -----------------------------------------------------------------------------
# Pod Security admission is on by default; the refusals below show it enforcing.
api_port=$(free_port)
t=$(now_ms)
"$APISERVER" --etcd-servers "http://127.0.0.1:$etcd_port" \
  --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$api_port" \
  --cert-dir "$WORK/certs" --tls-cert-file "$WORK/apiserver.crt" --tls-private-key-file "$WORK/apiserver.key" \
  --token-auth-file "$WORK/tokens.csv" --authorization-mode RBAC \
  --service-account-issuer https://kubernetes.default.svc.cluster.local \
  --service-account-key-file "$WORK/sa.pub" --service-account-signing-key-file "$WORK/sa.key" \
  --service-cluster-ip-range 10.96.0.0/16 --endpoint-reconciler-type none >"$WORK/apiserver.log" 2>&1 &
pids+=($!)
export KUBECONFIG="$WORK/kubeconfig"
cat >"$KUBECONFIG" <<EOF
apiVersion: v1
kind: Config
clusters:
  - name: test
    cluster: {server: "https://127.0.0.1:$api_port", certificate-authority: "$WORK/ca.crt"}
users:
  - name: admin
    user: {tokenFile: "$WORK/token"}
contexts:
  - name: test
    context: {cluster: test, user: admin}
current-context: test
EOF
WAIT_INTERVAL=0.25 wait_ready 60 "kube-apiserver's /readyz (process ${pids[0]} etcd, ${pids[1]} kube-apiserver)" \
  "${pids[0]} ${pids[1]}" "" quietly kubectl get --raw /readyz || fail "kube-apiserver not ready"
ready=$(secs $(($(now_ms) - t)))
log "kube-apiserver v$KUBERNETES_VERSION ready in $ready (etcd $etcd_version; loopback :$api_port)"

# -- CRDs -----------------------------------------------------------------------------------------
keda=$(go_module_dir "github.com/kedacore/keda/v2@$KEDA_VERSION")
po=$(go_module_dir "github.com/prometheus-operator/prometheus-operator@$PROMETHEUS_OPERATOR_VERSION")
kubectl apply --server-side -f "$keda/config/crd/bases/keda.sh_scaledobjects.yaml" \
  -f "$keda/config/crd/bases/keda.sh_triggerauthentications.yaml" \
  -f "$po/example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml" >/dev/null
kubectl wait --for condition=established --timeout 60s \
  crd/scaledobjects.keda.sh crd/triggerauthentications.keda.sh \
  crd/podmonitors.monitoring.coreos.com >/dev/null
log "CRDs established: ScaledObject and TriggerAuthentication (KEDA $KEDA_VERSION), PodMonitor (Prometheus Operator $PROMETHEUS_OPERATOR_VERSION)"

# -- the base and every overlay -------------------------------------------------------------------
cp -r deploy/k8s "$WORK/k8s"
# Every *.example file stands in for its uncommitted original (env files, tokens, CAs).
while IFS= read -r f; do cp "$f" "${f%.example}"; done < <(find "$WORK"/k8s/overlays -name '*.example')
accepted=()
previous=""
apply() { # apply NAME DIR
  local name="$1" dir="$2" tag="${1//[^a-z0-9]/-}"
  local out="$WORK/$tag.yaml" live="$WORK/$tag.live.json" pods="$WORK/$tag.pods.json"
  kubectl kustomize "$dir" >"$out"
  # Each kustomization into an empty namespace: the previous one's objects are deleted.
  # Namespaces stay (deleting one needs kube-controller-manager's namespace controller).
  if [ -n "$previous" ]; then
    python3 -c 'import json, sys
d = json.load(open(sys.argv[1]))
json.dump({"apiVersion": "v1", "kind": "List",
           "items": [o for o in d["items"] if o["kind"] != "Namespace"]}, sys.stdout)' "$previous" >"$WORK/delete.json"
    kubectl delete --wait -f "$WORK/delete.json" >/dev/null
  fi
  if ! kubectl apply --server-side --field-manager sluice-test --validate=strict \
      --warnings-as-errors -f "$out" >"$WORK/apply.log" 2>&1; then
    cat "$WORK/apply.log" >&2
    fail "$name: not accepted"
  fi
  local want got kinds
  want=$(grep -c '^kind:' "$out")
  kubectl get -f "$out" -o json >"$live"
  got=$(python3 -c 'import json, sys; print(len(json.load(open(sys.argv[1]))["items"]))' "$live")
  [ "$got" -eq "$want" ] || fail "$name: $want objects applied, $got read back"
  previous="$live"
  kinds=$(grep '^kind:' "$out" | sort | uniq -c | awk '{printf "%s%s %s", sep, $1, $3; sep=", "}')
  # The ServiceAccount controller (kube-controller-manager, not run here) would make each
  # namespace's `default` account; Pods are refused without it.
  python3 tests/k8s/pods_from_deployments.py <"$live" >"$pods"
  local ns
  for ns in $(python3 -c 'import json, sys
print(" ".join(sorted({p["metadata"]["namespace"] for p in json.load(open(sys.argv[1]))["items"]})))' "$pods"); do
    kubectl get serviceaccount default -n "$ns" >/dev/null 2>&1 ||
      kubectl create serviceaccount default -n "$ns" >/dev/null
  done
  if ! kubectl create --dry-run=server --warnings-as-errors -f "$pods" >"$WORK/pods.log" 2>&1; then
    cat "$WORK/pods.log" >&2
    fail "$name: a Deployment's pod template is refused under Pod Security"
  fi
  local npods
  npods=$(grep -c '/.*created (server dry run)' "$WORK/pods.log") || true
  accepted+=("$name: $want objects applied and read back ($kinds); $npods Pods from its Deployments admitted")
  log "${accepted[-1]}"
}
[ "$(kubectl get namespace sluice -o name 2>/dev/null)" = "" ] || fail "namespace sluice exists before the apply"
apply base "$WORK/k8s/base"
kubectl get namespace sluice -o jsonpath='{.metadata.labels.pod-security\.kubernetes\.io/enforce}' | grep -qx restricted ||
  fail "namespace sluice does not enforce restricted"
for overlay in "$WORK"/k8s/overlays/*/; do
  apply "overlay $(basename "$overlay")" "$overlay"
done

# -- broken manifests, each must be refused -------------------------------------------------------
refusals=()
refused() { # refused WHAT PATTERN COMMAND...: the command must fail with PATTERN in its output
  local what="$1" pattern="$2" first message
  shift 2
  if "$@" >"$WORK/broken.log" 2>&1; then
    cat "$WORK/broken.log" >&2
    fail "accepted: $what"
  fi
  message=$(grep -m1 -iE "$pattern" "$WORK/broken.log") ||
    { cat "$WORK/broken.log" >&2; fail "$what: refused for another reason"; }
  first=$(head -n 1 "$WORK/broken.log")   # "Error from server ...", "The X is invalid:"
  [ "$first" = "$message" ] || message="$first $message"
  message=$(printf '%s' "$message" | sed "s#$WORK/##g" | cut -c1-500)
  refusals+=("$what" "$message")
  log "refused, as it must be: $what"
}
for way in escalation root; do
  python3 tests/k8s/pods_from_deployments.py --break "$way" <"$WORK/base.live.json" >"$WORK/broken-$way.json"
done
refused "a Pod from a template with allowPrivilegeEscalation: true (Pod Security restricted)" \
  'violates PodSecurity' kubectl create --dry-run=server -f "$WORK/broken-escalation.json"
refused "a Pod from a template without runAsNonRoot (Pod Security restricted)" \
  'violates PodSecurity' kubectl create --dry-run=server -f "$WORK/broken-root.json"

# The first Deployment as rendered, with a misspelt field.
kubectl create --dry-run=client -f "$WORK/base.yaml" -o json | python3 -c 'import json, sys
text, objects, i = sys.stdin.read(), [], 0
while text[i:].strip():  # one JSON document per object
    o, i = json.JSONDecoder().raw_decode(text, len(text) - len(text[i:].lstrip()))
    objects.append(o)
d = next(o for o in objects if o["kind"] == "Deployment")
d["spec"]["replicass"] = 2
json.dump(d, sys.stdout)' >"$WORK/broken-field.json"
refused "a Deployment with a misspelt field, spec.replicass (strict field validation)" \
  'unknown field|not declared in schema' \
  kubectl apply --server-side --field-manager sluice-test --validate=strict -f "$WORK/broken-field.json"

cat >"$WORK/broken-scaledobject.yaml" <<'EOF'
apiVersion: keda.sh/v1alpha1
kind: ScaledObject
metadata: {name: broken, namespace: sluice}
spec:
  triggers:
    - type: cpu
      metricType: Utilization
      metadata: {value: "70"}
EOF
refused "a ScaledObject without scaleTargetRef (the CRD's schema)" 'scaleTargetRef|Required value' \
  kubectl apply --server-side --field-manager sluice-test --validate=strict -f "$WORK/broken-scaledobject.yaml"

# -- summary ----------------------------------------------------------------------------------------
echo "== test-k8s: passed (kube-apiserver v$KUBERNETES_VERSION, etcd $etcd_version)"
for a in "${accepted[@]}"; do echo "accepted  $a"; done
for ((i = 0; i < ${#refusals[@]}; i += 2)); do
  echo "refused   ${refusals[i]}:"
  echo "          ${refusals[i + 1]}"
done
echo "timings   kube-apiserver: $build; start to /readyz: $ready; whole run: $((SECONDS - T0)) s"
