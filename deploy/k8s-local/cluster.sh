#!/usr/bin/env bash
# A two-node Kubernetes made of upstream parts, on this machine, to run deploy/k8s for
# real: pods scheduled, probes called by a kubelet, Services routed by kube-proxy, a node
# drained while its pods move to the other.
#
#   deploy/k8s-local/cluster.sh start         start the nodes (wiping any previous state), wait until Ready
#   deploy/k8s-local/cluster.sh stop          stop every process, remove the pods, mounts, networks and rules
#   deploy/k8s-local/cluster.sh status        exit 0 when the API answers and every node is Ready
#   deploy/k8s-local/cluster.sh env           `export KUBECONFIG=...` (the admin's kubeconfig)
#   deploy/k8s-local/cluster.sh import IMAGE  copy IMAGE from the Docker engine into every node's containerd
#   deploy/k8s-local/cluster.sh addons        install CoreDNS, metrics-server and KEDA (below) on the running node
#   deploy/k8s-local/cluster.sh build         build (or find cached) every binary of the node and add-ons
#   deploy/k8s-local/cluster.sh logs          where each component's log is
#
# Parts, all at KUBERNETES_VERSION (scripts/deploy-lib.sh):
#   - etcd (Debian's etcd-server) on 127.0.0.1:12379;
#   - kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and kube-proxy, built
#     from the Go module proxy once and cached under $SLUICE_CACHE/k8s/bin (no release
#     binaries can be downloaded here);
#   - Debian's containerd (its own socket, root and state: not Docker's), runc, and CNI
#     plugins (bridge, host-local, loopback, portmap, firewall);
#   - the sandbox ("pause") image compiled from Kubernetes' own build/pause/linux/pause.c
#     (in the k8s.io/kubernetes module) into a one-file image: no registry is reachable.
# Nodes (SLUICE_K8S_NODES, 2 by default, or 1): node I is a kubelet with a containerd of
# its own (own socket, root and CNI network) on its own bridge sluice-k8s<I-1> with
# 10.244.<I-1>.1/24, made before anything starts: that is the node's address (its kubelet
# :10250) and its pods get 10.244.<I-1>.10-250. Node 2's kubelet keeps its pods under the
# cgroup /sluice-node-2, so that neither kubelet takes the other's pods for orphans. Both
# bridges are on this host, so pods of either node reach each other through its routing
# table. The control plane runs on node 1's address (kube-apiserver
# https://10.244.0.1:6443); Services 10.96.0.0/16 through one kube-proxy (iptables mode: the
# rules are this host's, which both nodes share). Pods reach the host at 10.244.0.1, so
# anything pods need from the host (a broker, a provider) binds there. Nothing leaves the machine: no route but the bridge. Cluster DNS (cluster.local,
# 10.96.0.10) is CoreDNS, an add-on (below): pods are given it from the start.
# Credentials: static tokens per component (system:masters only for the admin), in files
# the kubeconfigs name (never argv); Node and RBAC authorization; the kubelet authenticates
# kube-apiserver by a client certificate and authorizes callers through the API
# (SubjectAccessReview); service-account tokens signed with a key made here.
#
# Add-ons (`addons`): CoreDNS COREDNS_VERSION (Service names: KEDA's metrics API server
# reaches its operator as keda-operator.keda.svc.cluster.local), metrics-server
# METRICS_SERVER_VERSION (the resource metrics API, which CPU triggers and HPAs need) and
# KEDA KEDA_VERSION (operator, metrics API server, admission webhooks), each built from its
# Go module as the main module (static, CGO off), put alone in a local image, and installed
# with manifests their projects publish: Kubernetes' own CoreDNS add-on
# (cluster/addons/dns/coredns in the k8s.io/kubernetes module, its template variables
# filled in), metrics-server's manifests/base, KEDA's config/default; changed only in image
# names, pull policy, and metrics-server trusting the node CA for the kubelet's certificate.
#
# Settings: SLUICE_CACHE (~/.cache/sluice), SLUICE_K8S_STATE (/var/lib/sluice-k8s: containerd
# wants a filesystem with overlayfs, and the kubelet root), SLUICE_K8S_READY_TIMEOUT (180 s),
# SLUICE_K8S_NODES (2).
# Needs root. Only one such node runs at a time (fixed ports, one bridge).
set -eEuo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
cd "$(dirname "$0")/../.."
. scripts/deploy-lib.sh
. scripts/prereqs.sh
. scripts/docker-lib.sh

CACHE="${SLUICE_CACHE:-$HOME/.cache/sluice}"
STATE="${SLUICE_K8S_STATE:-/var/lib/sluice-k8s}"
RUN=/run/sluice-k8s
READY_TIMEOUT="${SLUICE_K8S_READY_TIMEOUT:-180}"
NODES="${SLUICE_K8S_NODES:-2}"
NODE=sluice-node                 # node 1; node I > 1 is sluice-node-I
NODE_IP=10.244.0.1
CLUSTER_CIDR=10.244.0.0/16       # node I's pods: 10.244.<I-1>.0/24
SERVICE_CIDR=10.96.0.0/16
DNS_IP=10.96.0.10
API="https://$NODE_IP:6443"
PAUSE_IMAGE=sluice.local/pause:3.10
SOCK="$RUN/containerd.sock"
export KUBECONFIG="$STATE/admin.kubeconfig"

LOG_TAG="k8s-local"
fail() { log "FAILED: $*"; exit 1; }
trap 'rc=$?; log "failed at line $LINENO (exit $rc): $BASH_COMMAND"' ERR

ctr_() { ctr --address "${CTR_SOCK:-$SOCK}" --namespace k8s.io "$@"; }

# node_vars I: node I's name, address, network, bridge, containerd socket and the suffix of
# its components' names (containerd-2, kubelet-2, ...; none for node 1).
node_vars() {
  N_SUFFIX=""
  [ "$1" -gt 1 ] && N_SUFFIX="-$1"
  N_NAME="$NODE$N_SUFFIX"
  N_NET="10.244.$(($1 - 1))"
  N_IP="$N_NET.1"
  N_BRIDGE="sluice-k8s$(($1 - 1))"
  N_SOCK="$RUN/containerd$N_SUFFIX.sock"
}
# How many nodes the running cluster has (written by start).
node_count() { cat "$STATE/nodes" 2>/dev/null || echo 1; }

# import_into_nodes TAR: an image archive into every node's containerd.
import_into_nodes() {
  local i
  for i in $(seq 1 "$(node_count)"); do
    node_vars "$i"
    CTR_SOCK="$N_SOCK" ctr_ images import "$1" >/dev/null
  done
}

# Where every kubelet on a host binds its device-plugin registration (fixed in the kubelet).
DEVICE_PLUGIN_SOCK=/var/lib/kubelet/device-plugins/kubelet.sock
components=(etcd kube-apiserver kube-controller-manager kube-scheduler containerd kubelet kube-proxy
  containerd-2 kubelet-2)

pid_of() { cat "$STATE/$1.pid" 2>/dev/null || true; }
alive() { local p; p=$(pid_of "$1"); [ -n "$p" ] && kill -0 "$p" 2>/dev/null; }

# launch NAME COMMAND...: in the background, its output in $STATE/NAME.log, its pid in NAME.pid.
launch() {
  local name="$1"
  shift
  nohup "$@" >"$STATE/$name.log" 2>&1 &
  echo $! >"$STATE/$name.pid"
}

# wait_for WHAT SECONDS COMMAND...: until COMMAND succeeds; fails naming WHAT, with the
# log of a component that has exited.
wait_for() {
  local what="$1" secs="$2"
  shift 2
  exited=""
  WAIT_INTERVAL=0.25 wait_until "$secs" "$what" up_or_exited "$@" || fail "$what: not within ${secs}s"
  if [ -n "$exited" ]; then
    log "$exited exited; the last lines of its log:"
    tail -n 30 "$STATE/$exited.log" >&2
    fail "$what: $exited exited"
  fi
}
# up_or_exited COMMAND...: wait_for's condition: COMMAND succeeds (its output discarded), or a
# launched component is no longer running (its name in $exited).
up_or_exited() {
  local c
  quietly "$@" && return 0
  for c in "${components[@]}"; do
    if [ -f "$STATE/$c.pid" ] && ! alive "$c"; then exited=$c; return 0; fi
  done
  return 1
}

binaries() {
  local c
  for c in kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy; do
    k8s_binary "$c" >/dev/null || fail "building $c"
  done
}
bin() { printf '%s/k8s/bin/%s-v%s' "$CACHE" "$1" "$KUBERNETES_VERSION"; }

# The sandbox image: Kubernetes' pause.c, compiled static once (cached beside the other
# binaries), alone in an image (~1 MB).
pause_image() {
  local bin="$CACHE/k8s/bin/pause-v3.10-sluice"
  if [ ! -x "$bin" ]; then
    mkdir -p "$CACHE/k8s/bin"
    gcc -Os -Wall -static -DVERSION=v3.10-sluice -o "$bin.tmp.$$" \
      "$(go_module_dir "k8s.io/kubernetes@v$KUBERNETES_VERSION")/build/pause/linux/pause.c"
    strip "$bin.tmp.$$"
    mv "$bin.tmp.$$" "$bin"
  fi
  one_file_image "$PAUSE_IMAGE" /pause 65535:65535 "$bin:pause"
}

pki() {
  local d="$STATE/pki"
  mkdir -p "$d"
  (
    cd "$d"
    umask 077
    openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=sluice-k8s-ca" -keyout ca.key -out ca.crt 2>/dev/null
    sign() { # sign NAME SUBJECT [SAN]
      openssl req -newkey rsa:2048 -nodes -subj "$2" -keyout "$1.key" -out "$1.csr" 2>/dev/null
      if [ -n "${3:-}" ]; then printf 'subjectAltName=%s\n' "$3" >"$1.ext"; else : >"$1.ext"; fi
      openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 \
        -extfile "$1.ext" -out "$1.crt" 2>/dev/null
    }
    sign apiserver "/CN=kube-apiserver" \
      "IP:$NODE_IP,IP:127.0.0.1,IP:10.96.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:localhost"
    # kube-apiserver's identity towards kubelets (logs, exec, port-forward).
    sign apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client"
    local i
    for i in $(seq 1 "$NODES"); do
      node_vars "$i"
      sign "kubelet$N_SUFFIX" "/CN=$N_NAME" "IP:$N_IP,DNS:$N_NAME"
    done
    # The aggregation layer (KEDA's external-metrics server): kube-apiserver proxies requests
    # to an APIService with this client certificate, under its own CA.
    openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=sluice-k8s-front-proxy-ca" \
      -keyout front-proxy-ca.key -out front-proxy-ca.crt 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -subj "/CN=front-proxy-client" -keyout front-proxy-client.key \
      -out front-proxy-client.csr 2>/dev/null
    openssl x509 -req -in front-proxy-client.csr -CA front-proxy-ca.crt -CAkey front-proxy-ca.key \
      -CAcreateserial -days 2 -out front-proxy-client.crt 2>/dev/null
    openssl genrsa -out sa.key 2048 2>/dev/null
    openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
    # One token per identity; kube-apiserver reads token,user,uid,"groups".
    : >tokens.csv
    local who file user group kubelets=()
    for i in $(seq 1 "$NODES"); do
      node_vars "$i"
      kubelets+=("kubelet$N_SUFFIX|system:node:$N_NAME|system:nodes")
    done
    for who in "admin|admin|system:masters" "controller-manager|system:kube-controller-manager|" \
      "scheduler|system:kube-scheduler|" "kube-proxy|system:kube-proxy|" "${kubelets[@]}"; do
      IFS='|' read -r file user group <<<"$who"
      python3 -c 'import secrets; print(secrets.token_hex(24))' >"$file.token"
      printf '%s,%s,%s,"%s"\n' "$(cat "$file.token")" "$user" "$user" "$group" >>tokens.csv
    done
  )
  local who i nodes=()
  for i in $(seq 1 "$NODES"); do node_vars "$i"; nodes+=("kubelet$N_SUFFIX"); done
  for who in admin controller-manager scheduler kube-proxy "${nodes[@]}"; do
    cat >"$STATE/$who.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
  - name: sluice-local
    cluster: {server: "$API", certificate-authority: "$d/ca.crt"}
users:
  - name: $who
    user: {tokenFile: "$d/$who.token"}
contexts:
  - name: sluice-local
    context: {cluster: sluice-local, user: $who}
current-context: sluice-local
EOF
  done
}

# network I: node I's bridge and its CNI network (containerd I reads $STATE/cni<suffix>).
network() {
  node_vars "$1"
  if ! ip link show "$N_BRIDGE" >/dev/null 2>&1; then
    ip link add "$N_BRIDGE" type bridge
  fi
  # A fixed MAC address. A bridge made with a random one takes the lowest MAC of its ports
  # and changes it when that port (a pod's veth) goes away; the node's other pods still
  # send to the gateway's old MAC until their ARP entry ages out, so their traffic to the
  # host (the broker, the provider, the kubelet's probes) vanished for up to a minute after
  # a pod was deleted: found as streams silent for 57-60 s during `kubectl drain`. An
  # address that was set is one the kernel never changes.
  ip link set "$N_BRIDGE" address "$(printf '02:73:6c:75:00:%02x' "$1")"
  ip addr replace "$N_IP/24" dev "$N_BRIDGE"
  ip link set "$N_BRIDGE" up
  sysctl -qw net.ipv4.ip_forward=1
  # Pod-to-Service traffic between pods on one bridge must pass through iptables.
  sysctl -qw net.bridge.bridge-nf-call-iptables=1 2>/dev/null || log "warning: bridge-nf-call-iptables not settable"
  mkdir -p "$STATE/cni$N_SUFFIX"
  cat >"$STATE/cni$N_SUFFIX/10-sluice.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "sluice-k8s$N_SUFFIX",
  "plugins": [
    {"type": "bridge", "bridge": "$N_BRIDGE", "isGateway": true, "ipMasq": true, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "$N_NET.0/24", "gateway": "$N_IP",
              "rangeStart": "$N_NET.10", "rangeEnd": "$N_NET.250"}]],
              "dataDir": "$STATE/cni-ipam$N_SUFFIX", "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}},
    {"type": "firewall", "backend": "iptables"}
  ]
}
EOF
}

# start_containerd I: node I's container runtime.
start_containerd() {
  node_vars "$1"
  mkdir -p "$RUN" "$STATE/containerd$N_SUFFIX"
  cat >"$STATE/containerd$N_SUFFIX.toml" <<EOF
version = 2
root = "$STATE/containerd$N_SUFFIX/root"
state = "$RUN/containerd$N_SUFFIX"
[grpc]
  address = "$N_SOCK"
[ttrpc]
  address = "$N_SOCK.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  enable_selinux = false
  # Root here lacks CAP_SYS_RESOURCE (a microVM's choice), so no process may lower its
  # oom_score_adj: without this the kubelet's -998 for sandboxes fails every pod ("can't get
  # final child's PID from pipe" from runc; "Permission denied" in runc's debug log).
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$STATE/cni$N_SUFFIX"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
EOF
  launch "containerd$N_SUFFIX" containerd --config "$STATE/containerd$N_SUFFIX.toml"
  wait_for "containerd$N_SUFFIX" 30 ctr --address "$N_SOCK" version
}

# start_kubelet I: node I's kubelet.
start_kubelet() {
  node_vars "$1"
  local p="$STATE/pki" k="$STATE/kubelet$N_SUFFIX" root=/ d
  if [ "$1" -gt 1 ]; then
    # Its own cgroup parent: each kubelet removes pod cgroups under its root that it does
    # not know (the other's pods). cpuset's must be given CPUs and memory nodes to hold tasks.
    root="/$N_NAME"
    for d in /sys/fs/cgroup/*/; do
      [ -e "${d}cgroup.procs" ] && mkdir -p "$d$N_NAME"
    done
    if [ -e /sys/fs/cgroup/cpuset/cpuset.cpus ]; then
      cat /sys/fs/cgroup/cpuset/cpuset.cpus >"/sys/fs/cgroup/cpuset/$N_NAME/cpuset.cpus"
      cat /sys/fs/cgroup/cpuset/cpuset.mems >"/sys/fs/cgroup/cpuset/$N_NAME/cpuset.mems"
    fi
  fi
  mkdir -p "$k" "$STATE/pod-logs$N_SUFFIX"
  cat >"$k.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $N_IP
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $((10248 + 10 * ($1 - 1)))
tlsCertFile: $p/kubelet$N_SUFFIX.crt
tlsPrivateKeyFile: $p/kubelet$N_SUFFIX.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $p/ca.crt}
authorization:
  mode: Webhook
cgroupDriver: cgroupfs
cgroupRoot: $root
containerRuntimeEndpoint: unix://$N_SOCK
failSwapOn: false
podLogsDir: $STATE/pod-logs$N_SUFFIX
resolvConf: /etc/resolv.conf
clusterDNS: [$DNS_IP]
clusterDomain: cluster.local
# This machine's disk is shared with builds: evict only when it is really full.
evictionHard: {memory.available: 200Mi, nodefs.available: 3%, imagefs.available: 3%}
imageGCHighThresholdPercent: 98
imageGCLowThresholdPercent: 97
# The ConfigMap a Deployment mounts is seen by its pods within seconds.
syncFrequency: 10s
serializeImagePulls: false
EOF
  launch "kubelet$N_SUFFIX" "$(bin kubelet)" --config "$k.yaml" \
    --kubeconfig "$STATE/kubelet$N_SUFFIX.kubeconfig" --root-dir "$k" \
    --hostname-override "$N_NAME" --node-ip "$N_IP"
}

start() {
  if status 2>/dev/null; then log "already running (reused)"; return 0; fi
  stop >/dev/null 2>&1 || true
  prereqs etcd:etcd-server containerd:containerd runc:runc conntrack:conntrack iptables:iptables \
    python3:python3 openssl:openssl gcc:gcc
  [ -x /usr/lib/cni/bridge ] || prereqs /usr/lib/cni/bridge:containernetworking-plugins
  command -v kubectl >/dev/null 2>&1 || fail "kubectl is needed"
  local t0=$SECONDS
  binaries
  case "$NODES" in 1 | 2) ;; *) fail "SLUICE_K8S_NODES must be 1 or 2, not $NODES" ;; esac
  rm -rf "$STATE"
  mkdir -p "$STATE"
  echo "$NODES" >"$STATE/nodes"
  pki
  local i
  for i in $(seq 1 "$NODES"); do network "$i"; done

  launch etcd etcd --name sluice-k8s --data-dir "$STATE/etcd" \
    --listen-client-urls http://127.0.0.1:12379 --advertise-client-urls http://127.0.0.1:12379 \
    --listen-peer-urls http://127.0.0.1:12380 --initial-advertise-peer-urls http://127.0.0.1:12380 \
    --initial-cluster sluice-k8s=http://127.0.0.1:12380
  local p="$STATE/pki"
  launch kube-apiserver "$(bin kube-apiserver)" --etcd-servers http://127.0.0.1:12379 \
    --bind-address "$NODE_IP" --advertise-address "$NODE_IP" --secure-port 6443 \
    --tls-cert-file "$p/apiserver.crt" --tls-private-key-file "$p/apiserver.key" \
    --client-ca-file "$p/ca.crt" --token-auth-file "$p/tokens.csv" \
    --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction \
    --kubelet-client-certificate "$p/apiserver-kubelet-client.crt" \
    --kubelet-client-key "$p/apiserver-kubelet-client.key" \
    --kubelet-preferred-address-types InternalIP \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-account-key-file "$p/sa.pub" --service-account-signing-key-file "$p/sa.key" \
    --service-cluster-ip-range "$SERVICE_CIDR" --cert-dir "$STATE/apiserver-certs" \
    --requestheader-client-ca-file "$p/front-proxy-ca.crt" --requestheader-allowed-names front-proxy-client \
    --requestheader-username-headers X-Remote-User --requestheader-group-headers X-Remote-Group \
    --requestheader-extra-headers-prefix X-Remote-Extra- \
    --proxy-client-cert-file "$p/front-proxy-client.crt" --proxy-client-key-file "$p/front-proxy-client.key" \
    --enable-aggregator-routing=true
  wait_for "kube-apiserver /readyz" 90 kubectl get --raw /readyz

  launch kube-controller-manager "$(bin kube-controller-manager)" \
    --kubeconfig "$STATE/controller-manager.kubeconfig" \
    --authentication-kubeconfig "$STATE/controller-manager.kubeconfig" \
    --authorization-kubeconfig "$STATE/controller-manager.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port 10257 --leader-elect=false \
    --service-account-private-key-file "$p/sa.key" --root-ca-file "$p/ca.crt" \
    --use-service-account-credentials --cluster-cidr "$CLUSTER_CIDR" \
    --service-cluster-ip-range "$SERVICE_CIDR" --allocate-node-cidrs=false \
    --node-monitor-grace-period 20s --horizontal-pod-autoscaler-sync-period 5s
  launch kube-scheduler "$(bin kube-scheduler)" --kubeconfig "$STATE/scheduler.kubeconfig" \
    --authentication-kubeconfig "$STATE/scheduler.kubeconfig" \
    --authorization-kubeconfig "$STATE/scheduler.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port 10259 --leader-elect=false

  for i in $(seq 1 "$NODES"); do start_containerd "$i"; done
  pause_image
  # One kubelet at a time. Every kubelet serves its device-plugin registration at the fixed
  # path /var/lib/kubelet/device-plugins/kubelet.sock (not under --root-dir) and empties that
  # directory before it binds; two starting together can interleave (one empties, the other
  # binds, the first's bind fails: "bind: address already in use", and that kubelet exits:
  # seen once in CI). Started in turn, the later one removes the earlier one's socket file,
  # which nothing here uses (no device plugins), and binds its own.
  for i in $(seq 1 "$NODES"); do
    rm -f "$DEVICE_PLUGIN_SOCK"
    start_kubelet "$i"
    wait_for "kubelet$N_SUFFIX's device-plugin socket" 60 test -S "$DEVICE_PLUGIN_SOCK"
  done

  cat >"$STATE/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $STATE/kube-proxy.kubeconfig}
hostnameOverride: $NODE
mode: iptables
clusterCIDR: $CLUSTER_CIDR
bindAddress: $NODE_IP
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
# Leave the kernel's conntrack table size alone (not settable on every machine).
conntrack: {maxPerCore: 0}
EOF
  launch kube-proxy "$(bin kube-proxy)" --config "$STATE/kube-proxy.yaml"

  wait_for "$NODES node(s) Ready" "$READY_TIMEOUT" node_ready
  # Pods are refused in a namespace until the ServiceAccount controller made its `default`.
  wait_for "the default ServiceAccount" 60 kubectl get serviceaccount default -n default
  log "$NODES node(s) Ready in $((SECONDS - t0)) s (Kubernetes v$KUBERNETES_VERSION, containerd $(containerd --version | awk '{print $3}'); API $API)"
}

# one_file_image IMAGE ENTRYPOINT USER PATH:NAME...: a local image holding only the given
# static binaries (at /NAME) and an empty /tmp, run as USER (uid:gid), cached as a tar under
# $CACHE/k8s/images (made once, with Docker), imported into every node's containerd.
one_file_image() {
  local image="$1" entry="$2" user="$3" out pair dir
  shift 3
  out="$CACHE/k8s/images/$(printf '%s' "$image" | tr '/:' '__').tar"
  if [ ! -s "$out" ]; then
    dir=$(mktemp -d)
    mkdir -p "$dir/root/tmp" "$CACHE/k8s/images"
    for pair in "$@"; do cp "${pair%%:*}" "$dir/root/${pair#*:}"; done
    tar -C "$dir/root" -cf "$dir/rootfs.tar" .
    docker_up || fail "dockerd did not start"
    docker import --change "ENTRYPOINT [\"$entry\"]" --change "USER $user" \
      "$dir/rootfs.tar" "$image" >/dev/null
    docker save "$image" -o "$out.tmp"
    mv "$out.tmp" "$out"
    rm -rf "$dir"
  fi
  import_into_nodes "$out"
}

# The KEDA triggers deploy/k8s uses (components/keda: pulsar and cpu; keda-in-flight:
# prometheus) and memory, the other resource trigger.
KEDA_TRIGGERS=(cpu memory prometheus pulsar)

# keda_used_scalers SRC: KEDA's source with only the scalers of KEDA_TRIGGERS. Every scaler is
# a file of one Go package (pkg/scalers) and the operator links all of them: from an empty
# build cache its build compiled ~3,300 packages (Elasticsearch's typed client alone ~960;
# Kafka, MongoDB, every cloud's SDK), 828 CPU-seconds, to use two. Without the other files and
# their cases in buildScaler (between TRIGGERS-START and TRIGGERS-END) it compiles ~1,550.
# A ScaledObject with another trigger gets KEDA's own "no scaler found for type" error.
keda_used_scalers() {
  local src="$1" f keep=" scaler.go " t
  for t in "${KEDA_TRIGGERS[@]}"; do
    case $t in
      cpu | memory) keep+=" cpu_memory_scaler.go " ;;
      *) keep+=" ${t//-/_}_scaler.go " ;;
    esac
  done
  for f in "$src"/pkg/scalers/*.go; do
    [[ $keep == *" ${f##*/} "* ]] || rm -f "$f"
  done
  # A constant the kept scalers use, declared in azure_queue_scaler.go.
  if ! grep -q 'externalMetricType *=' "$src"/pkg/scalers/*.go; then
    printf 'package scalers\n\nconst externalMetricType = "External"\n' >"$src/pkg/scalers/sluice_kept.go"
  fi
  python3 - "$src/pkg/scaling/scalers_builder.go" "${KEDA_TRIGGERS[@]}" <<'PYEOF'
import re, sys
path, keep = sys.argv[1], set(sys.argv[2:])
s = open(path).read()
start = s.index("// TRIGGERS-START")
a = s.index("\tswitch triggerType {\n", start)
b = s.index("// TRIGGERS-END", a)
b = s.rindex("\n", a, b)
head = "\tswitch triggerType {"
cases = re.split(r"(?=\n\tcase |\n\tdefault:)", s[a + len(head):b])
kept = [c for c in cases
        if c.startswith("\n\tdefault:")
        or ((m := re.match(r'\n\tcase "([^"]+)"', c)) and m.group(1) in keep)]
if len(kept) != len(keep) + 1:
    sys.exit(f"buildScaler: kept {len(kept)} cases for {sorted(keep)} and default")
open(path, "w").write(s[:a] + head + "".join(kept) + s[b:])
PYEOF
}

# The CoreDNS plugins the Corefile of Kubernetes' CoreDNS add-on uses ("prometheus" is the
# metrics plugin).
COREDNS_PLUGINS=(errors health ready kubernetes metrics forward cache loop reload loadbalance)

# coredns_used_plugins SRC: CoreDNS's source linking only COREDNS_PLUGINS. Every plugin is
# linked by one blank import in core/plugin/zplugin.go (generated from plugin.cfg); dropping
# the others (route53's AWS SDK, Azure, Cloud DNS, etcd, gRPC, ...) takes the build from
# ~1,380 Go packages to ~800 (`go list -deps .`) and the binary from 76 MB to 53 MB.
coredns_used_plugins() {
  python3 - "$1/core/plugin/zplugin.go" "${COREDNS_PLUGINS[@]}" <<'PYEOF'
import re, sys
path, keep = sys.argv[1], set(sys.argv[2:])
out, seen = [], set()
for line in open(path).read().split("\n"):
    m = re.fullmatch(r'\t_ "github.com/coredns/coredns/plugin/([a-z0-9_]+)"', line)
    if m and m.group(1) not in keep:
        continue
    if m:
        seen.add(m.group(1))
    out.append(line)
if seen != keep:
    sys.exit(f"zplugin.go does not import {sorted(keep - seen)}")
open(path, "w").write("\n".join(out))
PYEOF
}

# The add-ons' binaries, each built once and cached (see go_module_binary); prints their paths:
# operator, metrics API server, admission webhooks, metrics-server, CoreDNS.
addon_binaries() {
  local keda="github.com/kedacore/keda/v2@$KEDA_VERSION" v
  v="-X=github.com/kedacore/keda/v2/version.Version=${KEDA_VERSION#v}"
  go_module_binary "$keda" ./cmd/operator keda-used-scalers "$v" keda_used_scalers ||
    fail "building KEDA's operator"
  go_module_binary "$keda" ./cmd/adapter keda-adapter-used-scalers "$v" keda_used_scalers ||
    fail "building KEDA's metrics API server"
  go_module_binary "$keda" ./cmd/webhooks keda-admission-webhooks-used-scalers "$v" keda_used_scalers ||
    fail "building KEDA's admission webhooks"
  go_module_binary "sigs.k8s.io/metrics-server@$METRICS_SERVER_VERSION" ./cmd/metrics-server metrics-server ||
    fail "building metrics-server"
  go_module_binary "github.com/coredns/coredns@$COREDNS_VERSION" . coredns-used-plugins "" coredns_used_plugins ||
    fail "building CoreDNS"
}

addons() {
  status || fail "the node is not running (start it first)"
  local t0=$SECONDS keda ms a="$STATE/addons" op ad wh msb dns
  keda="github.com/kedacore/keda/v2@$KEDA_VERSION"
  ms="sigs.k8s.io/metrics-server@$METRICS_SERVER_VERSION"
  { read -r op; read -r ad; read -r wh; read -r msb; read -r dns; } < <(addon_binaries)
  [ -x "$dns" ] || fail "the add-on binaries were not built"
  # Tagged apart from a build of every scaler, which a cache may hold.
  one_file_image "sluice.local/keda:$KEDA_VERSION-used-scalers" /keda 65532:65532 "$op:keda" "$ad:keda-adapter" "$wh:keda-admission-webhooks"
  one_file_image "sluice.local/metrics-server:$METRICS_SERVER_VERSION" /metrics-server 65532:65532 "$msb:metrics-server"
  # Root in the container, as the add-on's manifest expects: it drops every capability but
  # NET_BIND_SERVICE (port 53).
  one_file_image "sluice.local/coredns:$COREDNS_VERSION-used-plugins" /coredns 0:0 "$dns:coredns"
  log "add-on binaries and images ready in $((SECONDS - t0)) s"

  rm -rf "$a"
  mkdir -p "$a/metrics-server" "$a/keda"
  # Kubernetes' CoreDNS add-on for its release, its variables filled in as its Makefile's
  # sed form expects (memory limit: the value kube-up uses).
  sed -e 's/\$DNS_DOMAIN/cluster.local/g' -e 's/\$DNS_MEMORY_LIMIT/170Mi/g' -e "s/\\\$DNS_SERVER_IP/$DNS_IP/g" \
    -e "s#image: registry.k8s.io/coredns/coredns:.*#image: sluice.local/coredns:$COREDNS_VERSION-used-plugins#" \
    "$(go_module_dir "k8s.io/kubernetes@v$KUBERNETES_VERSION")/cluster/addons/dns/coredns/coredns.yaml.sed" >"$a/coredns.yaml"
  ! grep -n '\$[A-Z_]' "$a/coredns.yaml" || fail "a variable of the CoreDNS add-on is left unfilled"
  kubectl apply --server-side --force-conflicts -f "$a/coredns.yaml" >/dev/null
  cp -r "$(go_module_dir "$ms")/manifests" "$a/metrics-server-manifests"
  cp -r "$(go_module_dir "$keda")/config" "$a/keda-config"
  chmod -R u+w "$a"
  cp "$STATE/pki/ca.crt" "$a/metrics-server/node-ca.crt"
  {
    echo "apiVersion: kustomize.config.k8s.io/v1beta1"
    echo "kind: Kustomization"
    echo "namespace: kube-system"
    echo "resources: [../metrics-server-manifests/base]"
    echo "images:"
    echo "  - {name: gcr.io/k8s-staging-metrics-server/metrics-server, newName: sluice.local/metrics-server, newTag: $METRICS_SERVER_VERSION}"
    echo "configMapGenerator:"
    echo "  - {name: node-ca, files: [node-ca.crt]}"
    echo "patches:"
    echo "  # The kubelet's serving certificate is signed by the node CA: trust it (no --kubelet-insecure-tls)."
    echo "  - target: {kind: Deployment, name: metrics-server}"
    echo "    patch: |-"
    echo "      - {op: add, path: /spec/template/spec/containers/0/args/-, value: --kubelet-certificate-authority=/etc/node-ca/node-ca.crt}"
    echo "      - {op: add, path: /spec/template/spec/containers/0/volumeMounts/-, value: {name: node-ca, mountPath: /etc/node-ca, readOnly: true}}"
    echo "      - {op: add, path: /spec/template/spec/volumes/-, value: {name: node-ca, configMap: {name: node-ca}}}"
  } >"$a/metrics-server/kustomization.yaml"
  {
    echo "apiVersion: kustomize.config.k8s.io/v1beta1"
    echo "kind: Kustomization"
    echo "resources: [../keda-config/default]"
    echo "images:"
    for i in keda keda-metrics-apiserver keda-admission-webhooks; do
      echo "  - {name: ghcr.io/kedacore/$i, newName: sluice.local/keda, newTag: $KEDA_VERSION-used-scalers}"
    done
    echo "patches:"
    echo "  # Always would ask a registry; the images are in the node's containerd."
    echo "  - target: {kind: Deployment}"
    echo "    patch: |-"
    echo "      - {op: replace, path: /spec/template/spec/containers/0/imagePullPolicy, value: IfNotPresent}"
  } >"$a/keda/kustomization.yaml"
  kubectl apply --server-side --force-conflicts -k "$a/metrics-server" >/dev/null
  kubectl apply --server-side --force-conflicts -k "$a/keda" >/dev/null
  local d
  for d in kube-system/coredns kube-system/metrics-server keda/keda-operator keda/keda-metrics-apiserver keda/keda-admission; do
    kubectl rollout status -n "${d%%/*}" "deployment/${d#*/}" --timeout 300s >/dev/null ||
      fail "add-on $d did not roll out"
  done
  wait_for "the metrics APIs (metrics.k8s.io, external.metrics.k8s.io) Available" 180 apis_available
  log "add-ons running in $((SECONDS - t0)) s: CoreDNS $COREDNS_VERSION, metrics-server $METRICS_SERVER_VERSION, KEDA $KEDA_VERSION"
}

apis_available() {
  local s
  for s in v1beta1.metrics.k8s.io v1beta1.external.metrics.k8s.io; do
    [ "$(kubectl get apiservice "$s" -o jsonpath='{.status.conditions[?(@.type=="Available")].status}')" = True ] || return 1
  done
  kubectl get --raw /apis/metrics.k8s.io/v1beta1/nodes | grep -q "$NODE"
}

node_ready() {
  local i
  for i in $(seq 1 "$(node_count)"); do
    node_vars "$i"
    [ "$(kubectl get node "$N_NAME" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" = True ] ||
      return 1
  done
}

status() {
  alive kube-apiserver && alive kubelet && node_ready
}

stop() {
  local c p
  # kube-proxy's rules, the kubelet, then every pod's containers and the runtime.
  for c in kube-proxy kubelet kubelet-2 kube-scheduler kube-controller-manager; do
    p=$(pid_of "$c"); [ -n "$p" ] && kill "$p" 2>/dev/null || true
  done
  if [ -x "$(bin kube-proxy)" ]; then "$(bin kube-proxy)" --cleanup >/dev/null 2>&1 || true; fi
  local i
  for i in 1 2; do
    node_vars "$i"
    if [ -S "$N_SOCK" ]; then
      for c in $(CTR_SOCK="$N_SOCK" ctr_ tasks ls -q 2>/dev/null); do
        CTR_SOCK="$N_SOCK" ctr_ tasks kill -s SIGKILL "$c" >/dev/null 2>&1 || true
      done
    fi
    # Shims of this containerd (their command line names its socket).
    pkill -9 -f "containerd-shim-runc-v2 .*-address $N_SOCK( |$)" 2>/dev/null || true
  done
  for c in containerd containerd-2 kube-apiserver etcd; do
    p=$(pid_of "$c"); [ -n "$p" ] && kill "$p" 2>/dev/null || true
  done
  for c in "${components[@]}"; do
    p=$(pid_of "$c")
    [ -n "$p" ] || continue
    WAIT_INTERVAL=0.25 wait_gone 10 "$c (pid $p) to exit" "$p" || true
    kill -9 "$p" 2>/dev/null || true
    rm -f "$STATE/$c.pid"
  done
  # Mounts left under the state (secrets' tmpfs, overlay rootfs) and the pods' network
  # namespaces, deepest first.
  awk -v s="$STATE" -v r="$RUN" 'index($2, s) == 1 || index($2, r) == 1 { print $2 }' /proc/mounts |
    sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
  for c in /run/netns/cni-*; do [ -e "$c" ] && { umount -l "$c" 2>/dev/null || true; rm -f "$c"; }; done
  # The CNI firewall plugin's chains, and the masquerade rules of the bridge plugin.
  iptables-save 2>/dev/null | awk '/^-A (POSTROUTING|FORWARD) .*CNI-/ { sub(/^-A/, "-D"); print }' |
    while read -r rule; do eval "iptables -t nat $rule" 2>/dev/null || eval "iptables $rule" 2>/dev/null || true; done
  for i in 1 2; do
    node_vars "$i"
    ip link del "$N_BRIDGE" 2>/dev/null || true
  done
  # Node 2's cgroup parent, once its pods' cgroups are empty.
  node_vars 2
  find /sys/fs/cgroup/*/"$N_NAME" -depth -type d -exec rmdir {} + 2>/dev/null || true
  rm -rf "$RUN"
}

case "${1:-}" in
  start) start ;;
  stop) stop; log "stopped" ;;
  status) status ;;
  env) printf 'export KUBECONFIG=%s\n' "$KUBECONFIG" ;;
  import)
    [ -n "${2:-}" ] || fail "usage: $0 import IMAGE"
    docker_up || fail "dockerd did not start"
    tar="$(mktemp "${TMPDIR:-/tmp}/sluice-k8s-image.XXXXXX")"
    docker save "$2" -o "$tar"
    import_into_nodes "$tar"
    rm -f "$tar"
    log "imported $2 into the containerd of $(node_count) node(s)"
    ;;
  addons) addons ;;
  build)
    t=$SECONDS
    binaries
    addon_binaries >/dev/null
    log "every binary built or cached in $((SECONDS - t)) s"
    ;;
  logs) for c in "${components[@]}"; do echo "$c: $STATE/$c.log"; done ;;
  *) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
