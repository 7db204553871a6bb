#!/usr/bin/env bash
# Applies sluice's Kubernetes manifests to a real API server on this machine:
#
#  - etcd from Debian's etcd-server, and kube-apiserver at the version the manifests are
#    checked against (scripts/deploy-lib.sh: 1.32.0), built from the Go module proxy once
#    and cached under ~/.cache/sluice/k8s (no release binaries can be downloaded here);
#  - both on loopback, on free ports, with their state in a temporary directory; the
#    admin's token is in a file the kubeconfig names (never argv);
#  - the KEDA ScaledObject and Prometheus Operator PodMonitor CRDs from those projects' Go
#    modules, established;
#  - the base and every overlay under deploy/k8s/overlays (rendered from a copy in which the
#    *.env.example files stand in for the uncommitted *.env) applied for real with
#    `kubectl apply --server-side --validate=strict --warnings-as-errors`: a Pod Security
#    warning on a Deployment fails it; every object is then read back;
#  - a Pod from every Deployment's template, created with --dry-run=server in the namespace,
#    so that Pod Security admission ENFORCES the namespace's `restricted` level (it only
#    warns on Deployments, and no controller-manager runs here to make the Pods);
#  - three broken manifests, each refused by the server with its message shown: a template
#    that allows privilege escalation (Pod Security), a misspelt field (strict validation)
#    and a ScaledObject without scaleTargetRef (the CRD's schema).
#
# Usage: scripts/test-k8s.sh. Needs go, python3, openssl and kubectl (installed when
# missing, kubectl excepted).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deploy-lib.sh
. scripts/prereqs.sh
prereqs go:golang-go python3:python3 openssl:openssl etcd:etcd-server
command -v kubectl >/dev/null 2>&1 || { echo "kubectl is needed" >&2; exit 1; }

CACHE="$HOME/.cache/sluice/k8s"
APISERVER="$CACHE/bin/kube-apiserver-v$KUBERNETES_VERSION"
WORK=$(mktemp -d)
T0=$SECONDS
log() { printf '[k8s] %s\n' "$*" >&2; }
fail() { log "FAILED: $*"; exit 1; }

pids=()
cleanup() {
  local rc=$? p
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

# -- kube-apiserver from the Go module proxy ----------------------------------------------------
# k8s.io/kubernetes requires its staging modules (k8s.io/api, ...) at v0.0.0 and replaces
# them with ./staging directories, which its module zip does not carry; a wrapper module
# replaces each with the version published for this release (v0.<minor>.<patch>).
if [ ! -x "$APISERVER" ]; then
  log "building kube-apiserver v$KUBERNETES_VERSION from the Go module proxy (once; cached)"
  t=$SECONDS
  src="$CACHE/src.$$"
  rm -rf "$src" && mkdir -p "$src" "$CACHE/bin"
  staging="v0.${KUBERNETES_VERSION#*.}"
  {
    printf 'module sluice.local/kube-apiserver\n\ngo 1.23\n\nrequire k8s.io/kubernetes v%s\n\n' "$KUBERNETES_VERSION"
    for m in api apiextensions-apiserver apimachinery apiserver cli-runtime client-go \
      cloud-provider cluster-bootstrap code-generator component-base component-helpers \
      controller-manager cri-api cri-client csi-translation-lib dynamic-resource-allocation \
      endpointslice externaljwt kms kube-aggregator kube-controller-manager kube-proxy \
      kube-scheduler kubectl kubelet metrics mount-utils pod-security-admission \
      sample-apiserver sample-cli-plugin sample-controller; do
      printf 'replace k8s.io/%s => k8s.io/%s %s\n' "$m" "$m" "$staging"
    done
  } >"$src/go.mod"
  minor="${KUBERNETES_VERSION#*.}"; minor="${minor%%.*}"
  (cd "$src" && GOFLAGS=-mod=mod go build -trimpath -ldflags "-s -w \
      -X k8s.io/component-base/version.gitVersion=v$KUBERNETES_VERSION \
      -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor" \
      -o "$APISERVER.tmp.$$" k8s.io/kubernetes/cmd/kube-apiserver) >"$WORK/build.log" 2>&1 ||
    { tail -n 30 "$WORK/build.log" >&2; rm -rf "$src"; fail "building kube-apiserver"; }
  mv "$APISERVER.tmp.$$" "$APISERVER"
  rm -rf "$src"
  log "built in $((SECONDS - t)) s"
fi
"$APISERVER" --version >&2

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# -- etcd ---------------------------------------------------------------------------------------
etcd_port=$(free_port)
peer_port=$(free_port)
etcd --name sluice-test --data-dir "$WORK/etcd" \
  --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
  --listen-peer-urls "http://127.0.0.1:$peer_port" --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
  --initial-cluster "sluice-test=http://127.0.0.1:$peer_port" >"$WORK/etcd.log" 2>&1 &
pids+=($!)

# -- certificates, the service-account key, the admin's token -----------------------------------
(
  cd "$WORK"
  openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj "/CN=sluice-test-ca" \
    -keyout ca.key -out ca.crt 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj "/CN=kube-apiserver" -keyout apiserver.key \
    -out apiserver.csr 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' >san.ext
  openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 \
    -extfile san.ext -out apiserver.crt 2>/dev/null
  openssl genrsa -out sa.key 2048 2>/dev/null
  openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
  umask 077
  python3 -c 'import secrets; print(secrets.token_hex(24))' >token
  printf '%s,admin,admin,system:masters\n' "$(cat token)" >tokens.csv
)

# -- kube-apiserver -----------------------------------------------------------------------------
api_port=$(free_port)
t=$SECONDS
"$APISERVER" --etcd-servers "http://127.0.0.1:$etcd_port" \
  --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$api_port" \
  --cert-dir "$WORK/certs" --tls-cert-file "$WORK/apiserver.crt" --tls-private-key-file "$WORK/apiserver.key" \
  --token-auth-file "$WORK/tokens.csv" --authorization-mode RBAC \
  --service-account-issuer https://kubernetes.default.svc.cluster.local \
  --service-account-key-file "$WORK/sa.pub" --service-account-signing-key-file "$WORK/sa.key" \
  --service-cluster-ip-range 10.96.0.0/16 >"$WORK/apiserver.log" 2>&1 &
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
for _ in $(seq 1 120); do
  kubectl get --raw /readyz >/dev/null 2>&1 && break
  kill -0 "${pids[1]}" 2>/dev/null || fail "kube-apiserver exited"
  sleep 0.5
done
kubectl get --raw /readyz >/dev/null 2>&1 || fail "kube-apiserver not ready after 60 s"
log "kube-apiserver v$KUBERNETES_VERSION ready in $((SECONDS - t)) s (etcd $(etcd --version | awk '/etcd Version/ {print $3}'), loopback :$api_port)"

# -- CRDs -----------------------------------------------------------------------------------------
keda=$(go_module_dir "github.com/kedacore/keda/v2@$KEDA_VERSION")
po=$(go_module_dir "github.com/prometheus-operator/prometheus-operator@$PROMETHEUS_OPERATOR_VERSION")
kubectl apply --server-side -f "$keda/config/crd/bases/keda.sh_scaledobjects.yaml" \
  -f "$po/example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml" >/dev/null
kubectl wait --for condition=established --timeout 60s \
  crd/scaledobjects.keda.sh crd/podmonitors.monitoring.coreos.com >/dev/null
log "CRDs established: ScaledObject (KEDA $KEDA_VERSION), PodMonitor (Prometheus Operator $PROMETHEUS_OPERATOR_VERSION)"

# -- the base and every overlay -------------------------------------------------------------------
cp -r deploy/k8s "$WORK/k8s"
for f in "$WORK"/k8s/overlays/*/*.env.example; do cp "$f" "${f%.example}"; done
apply() { # apply NAME DIR
  local name="$1" dir="$2" out="$WORK/$1.yaml"
  kubectl kustomize "$dir" >"$out"
  if ! kubectl apply --server-side --field-manager sluice-test --validate=strict \
      --warnings-as-errors -f "$out" >"$WORK/apply.log" 2>&1; then
    cat "$WORK/apply.log" >&2
    fail "$name: not accepted"
  fi
  local want got
  want=$(grep -c '^kind:' "$out")
  got=$(kubectl get -f "$out" -o name | wc -l)
  [ "$got" -eq "$want" ] || fail "$name: $want objects applied, $got read back"
  # The ServiceAccount controller (kube-controller-manager, not run here) would make each
  # namespace's `default` account; Pods are refused without it.
  kubectl get serviceaccount default -n sluice >/dev/null 2>&1 ||
    kubectl create serviceaccount default -n sluice >/dev/null
  kubectl get deployments -n sluice -o json | python3 tests/k8s/pods_from_deployments.py >"$WORK/pods.json"
  if ! kubectl create --dry-run=server --warnings-as-errors -f "$WORK/pods.json" >"$WORK/pods.log" 2>&1; then
    cat "$WORK/pods.log" >&2
    fail "$name: a Deployment's pod template is refused under Pod Security restricted"
  fi
  log "$name: $want objects applied and read back ($(grep '^kind:' "$out" | sort | uniq -c | awk '{printf "%s%s %s", sep, $1, $3; sep=", "}')); $(python3 -c 'import json, sys; print(len(json.load(open(sys.argv[1]))["items"]))' "$WORK/pods.json") pods from its templates admitted under restricted"
}
[ "$(kubectl get namespace sluice -o name 2>/dev/null)" = "" ] || fail "namespace sluice exists before the apply"
apply base "$WORK/k8s/base"
kubectl get namespace sluice -o jsonpath='{.metadata.labels.pod-security\.kubernetes\.io/enforce}' | grep -qx restricted ||
  fail "namespace sluice does not enforce restricted"
for overlay in "$WORK"/k8s/overlays/*/; do
  apply "overlay $(basename "$overlay")" "$overlay"
done

# -- broken manifests, each must be refused -------------------------------------------------------
refused() { # refused WHAT PATTERN COMMAND...: the command must fail with PATTERN in its output
  local what="$1" pattern="$2"
  shift 2
  if "$@" >"$WORK/broken.log" 2>&1; then
    cat "$WORK/broken.log" >&2
    fail "accepted: $what"
  fi
  grep -qiE "$pattern" "$WORK/broken.log" || { cat "$WORK/broken.log" >&2; fail "$what: refused for another reason"; }
  log "refused, as it must be: $what:"
  grep -iE "$pattern" "$WORK/broken.log" | head -2 | cut -c1-300 | sed 's/^/    /' >&2
}
kubectl get deployments -n sluice -o json | python3 tests/k8s/pods_from_deployments.py --break >"$WORK/broken-pods.json"
refused "a pod template allowing privilege escalation (Pod Security restricted)" "violates PodSecurity" \
  kubectl create --dry-run=server -f "$WORK/broken-pods.json"
python3 - "$WORK/base.yaml" "$WORK/broken-field.yaml" <<'EOF'
import sys
docs = open(sys.argv[1]).read().split("\n---\n")
out = []
for d in docs:
    if "\nkind: Deployment\n" in "\n" + d + "\n" and not any("replicass" in o for o in out):
        d = d.replace("\nspec:\n", "\nspec:\n  replicass: 2\n", 1)
    out.append(d)
open(sys.argv[2], "w").write("\n---\n".join(out))
EOF
refused "a Deployment with a misspelt field (spec.replicass)" "unknown field|not declared in schema" \
  kubectl apply --server-side --field-manager sluice-test --validate=strict -f "$WORK/broken-field.yaml"
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
refused "a ScaledObject without scaleTargetRef (the CRD's schema)" "scaleTargetRef|Required value" \
  kubectl apply --server-side --field-manager sluice-test --validate=strict -f "$WORK/broken-scaledobject.yaml"

log "passed in $((SECONDS - T0)) s"
