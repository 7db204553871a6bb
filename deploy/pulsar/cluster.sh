#!/usr/bin/env bash
# A secured, multi-broker Apache Pulsar cluster on this machine's loopback, as production runs
# Pulsar: ZooKeeper, 3 bookies, 2 brokers, TLS only, JWT authentication, authorization with
# least-privilege roles. For the production-Pulsar suite (services/cli/tests/cluster.rs) and
# for trying sluice against a secured cluster by hand.
#
#   deploy/pulsar/cluster.sh start            start (or reuse) the cluster, wait until it serves
#   deploy/pulsar/cluster.sh start-fresh      stop, delete the data (not the keys), start
#   deploy/pulsar/cluster.sh stop             stop every process (SIGTERM, then SIGKILL)
#   deploy/pulsar/cluster.sh wipe             stop, delete the state, remove the /etc/hosts lines
#   deploy/pulsar/cluster.sh status           exit 0 when both brokers and 3 bookies serve
#   deploy/pulsar/cluster.sh env              `export` lines for a client or a test harness
#   deploy/pulsar/cluster.sh kill-broker N    SIGKILL broker N (1 or 2)
#   deploy/pulsar/cluster.sh stop-broker N    SIGTERM broker N, wait until it is gone
#   deploy/pulsar/cluster.sh start-broker N   start broker N, wait until it serves
#   deploy/pulsar/cluster.sh restart-broker N stop-broker then start-broker
#   deploy/pulsar/cluster.sh kill-bookie N    SIGKILL bookie N (1 to 3)
#   deploy/pulsar/cluster.sh start-bookie N   start bookie N, wait until it is registered
#   deploy/pulsar/cluster.sh unload NS        unload namespace NS (tenant/namespace) everywhere
#   deploy/pulsar/cluster.sh owner TOPIC      the broker URL that owns TOPIC now
#   deploy/pulsar/cluster.sh grant ROLE ACTIONS TOPIC   e.g. grant sluice-gateway produce persistent://tg/request/x
#   deploy/pulsar/cluster.sh grant-roles TS   every role's grants on topicspace TS's default topics
#   deploy/pulsar/cluster.sh revoke ROLE TOPIC
#   deploy/pulsar/cluster.sh admin ARGS...    bin/pulsar-admin as the superuser, over HTTPS
#
# Layout (all on loopback, none of the ports of deploy/pulsar/pulsar.sh):
#   ZooKeeper 127.0.0.1:2191 (AdminServer off; its metrics on 127.0.0.1:2194)
#   bookies   127.0.0.1:3191, :3192, :3193 (HTTP and stats servers off)
#   broker 1  127.0.0.2:6651 (pulsar+ssl) and :8443 (https); broker 2 the same on 127.0.0.3
#   clients   pulsar+ssl://pulsar.sluice.test:6651: the name resolves to both brokers
#             (/etc/hosts), as a DNS name in front of a real cluster does
# Plaintext ports are off. The CA, the broker certificate (SANs: pulsar.sluice.test,
# 127.0.0.2, 127.0.0.3), an unrelated CA for tests, the token secret key and the tokens are
# made once (openssl, python3) and kept in the state directory. Tokens (files under tokens/):
#   admin (superuser, set-up only); one per sluice role: text-completion
#   (sluice-text-completion), prompt (sluice-prompt), agent (sluice-agent), gateway
#   (sluice-gateway); nobody (sluice-nobody, never granted anything), expired
#   (sluice-text-completion, expired an hour before it was made), forged (role admin, signed
#   with another key). The set-up grants each role what it needs on topicspace tg's default
#   topics and nothing more (docs/production-pulsar.md#roles-and-grants).
#
# Settings (environment): SLUICE_CACHE (~/.cache/sluice), PULSAR_CLUSTER_DIR
# ($SLUICE_CACHE/pulsar-cluster), PULSAR_CLUSTER_READY_TIMEOUT (300 s),
# PULSAR_CLUSTER_ENSEMBLE / _WRITE_QUORUM / _ACK_QUORUM (2 / 2 / 2, see below), PULSAR_CLUSTER_BROKER_HEAP
# (384m), PULSAR_CLUSTER_BOOKIE_HEAP (256m).
set -eEuo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
LOG_TAG="pulsar-cluster"
# Whatever stops the script says where: a start that fails in the background of the test
# command must leave more than an empty log.
trap 'log "failed (exit $?) at line $LINENO: $BASH_COMMAND"' ERR

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SCRIPT="$HERE/$(basename "${BASH_SOURCE[0]}")"
CACHE="${SLUICE_CACHE:-$HOME/.cache/sluice}"
STATE="${PULSAR_CLUSTER_DIR:-$CACHE/pulsar-cluster}"
READY_TIMEOUT="${PULSAR_CLUSTER_READY_TIMEOUT:-300}"
# Ensemble 2 of 3 bookies, every entry on both (write 2), both must confirm (ack 2): one
# bookie down still leaves 2 for every new ledger. Ensemble 3 on 3 bookies does NOT survive
# one bookie down: measured here, after a bookie was killed and restarted, the brokers'
# BookKeeper clients quarantined it (bookkeeperClientHealthCheckQuarantineTimeInSeconds,
# 1800 s by default) and every new ledger failed with "Not enough non-faulty bookies", so
# each topic move or broker restart afterwards left its topics unusable for half an hour.
ENSEMBLE="${PULSAR_CLUSTER_ENSEMBLE:-2}"
WRITE_QUORUM="${PULSAR_CLUSTER_WRITE_QUORUM:-2}"
ACK_QUORUM="${PULSAR_CLUSTER_ACK_QUORUM:-2}"
BROKER_HEAP="${PULSAR_CLUSTER_BROKER_HEAP:-384m}"
BOOKIE_HEAP="${PULSAR_CLUSTER_BOOKIE_HEAP:-256m}"
NAME=pulsar.sluice.test
ZK=127.0.0.1:2191
CLUSTER=sluice

broker_ip() { echo "127.0.0.$(($1 + 1))"; }
bookie_port() { echo "$((3190 + $1))"; }

# Pulsar 4.x wants Java 21 or newer: the same choice as pulsar.sh, made there.
find_java() { bash "$HERE/pulsar.sh" java; }

# Sets `key=value` lines in a Java properties file: removes every earlier line of the key
# first, because Pulsar's config reader takes a key given twice as a list.
conf_set() {
  local file="$1" line key
  shift
  # The distribution's files may end without a newline: the first line set would join it.
  [ -z "$(tail -c 1 "$file")" ] || printf '\n' >> "$file"
  for line in "$@"; do
    key="${line%%=*}"
    sed -i "/^${key//./\\.}=/d" "$file"
    printf '%s\n' "$line" >> "$file"
  done
}

# -- credentials --------------------------------------------------------------------------------
make_pki() {
  local pki="$STATE/pki"
  [ -f "$pki/.complete" ] && return 0
  command -v openssl >/dev/null || { apt-get update -qq && apt-get install -y -qq openssl >/dev/null; }
  rm -rf "$pki" && mkdir -p "$pki"
  (
    cd "$pki"
    openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=sluice test CA" \
      -keyout ca.key -out ca.pem 2>/dev/null
    openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=an untrusted CA" \
      -keyout untrusted-ca.key -out untrusted-ca.pem 2>/dev/null
    # PKCS#8 key (what genpkey writes), as the broker's TLS needs.
    openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out broker.key 2>/dev/null
    openssl req -new -key broker.key -subj "/CN=$NAME" -out broker.csr 2>/dev/null
    printf '%s\n' "basicConstraints=CA:FALSE" "keyUsage=digitalSignature,keyEncipherment" \
      "extendedKeyUsage=serverAuth" \
      "subjectAltName=DNS:$NAME,IP:127.0.0.2,IP:127.0.0.3" > broker.ext
    openssl x509 -req -in broker.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 3650 \
      -extfile broker.ext -out broker.pem 2>/dev/null
  )
  touch "$pki/.complete"
}

# HS256 JWTs, the format `bin/pulsar tokens create` writes (sub = the role; exp optional),
# made with python3 instead of one JVM per token.
jwt() {
  python3 - "$1" "$2" "$3" <<'PY'
import base64, hashlib, hmac, json, sys, time
key = open(sys.argv[1], "rb").read()
claims = {"sub": sys.argv[2]}
if sys.argv[3]:
    claims["exp"] = int(time.time()) + int(sys.argv[3])
b64 = lambda b: base64.urlsafe_b64encode(b).rstrip(b"=").decode()
head = b64(json.dumps({"alg": "HS256"}, separators=(",", ":")).encode())
body = b64(json.dumps(claims, separators=(",", ":")).encode())
sig = b64(hmac.new(key, f"{head}.{body}".encode(), hashlib.sha256).digest())
print(f"{head}.{body}.{sig}")
PY
}

# The roles of sluice's services: each gets a token of its own (tokens/<service>.token,
# role sluice-<service>).
ROLES="text-completion prompt agent gateway"

make_tokens() {
  local t="$STATE/tokens" role
  if [ ! -f "$t/.complete" ]; then
    rm -rf "$t" && mkdir -p "$t" && chmod 700 "$t"
    # The broker's key (what `bin/pulsar tokens create-secret-key` makes: 32 random bytes).
    head -c 32 /dev/urandom > "$STATE/secret.key"
    head -c 32 /dev/urandom > "$STATE/other-secret.key"
    jwt "$STATE/secret.key" admin "" > "$t/admin.token"
    jwt "$STATE/secret.key" sluice-nobody "" > "$t/nobody.token"
    jwt "$STATE/other-secret.key" admin "" > "$t/forged.token"
    chmod 600 "$t"/*.token "$STATE"/*.key
    touch "$t/.complete"
  fi
  # Made when missing, with the key kept: a state directory from before the processors had a
  # role each gets the new tokens without a new key (its brokers' data stays valid). A token
  # is written whole under another name first, so a crash leaves none half-written.
  for role in $ROLES; do
    make_token "$role.token" "sluice-$role" ""
  done
  make_token expired.token sluice-text-completion -3600
}

# make_token FILE ROLE EXPIRY: tokens/FILE for ROLE unless it exists and names ROLE.
make_token() {
  local file="$STATE/tokens/$1"
  if [ -f "$file" ] && [ "$(token_role "$file")" = "$2" ]; then
    return 0
  fi
  jwt "$STATE/secret.key" "$2" "$3" > "$file.tmp"
  chmod 600 "$file.tmp"
  mv "$file.tmp" "$file"
}

# The role (`sub`) a token names.
token_role() {
  python3 - "$1" <<'PY'
import base64, json, sys
body = open(sys.argv[1]).read().strip().split(".")[1]
print(json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))["sub"])
PY
}

hosts_block() {
  if ! grep -q '# sluice-cluster begin' /etc/hosts 2>/dev/null; then
    printf '%s\n' "# sluice-cluster begin" "127.0.0.2 $NAME" "127.0.0.3 $NAME" \
      "127.0.0.2 wrong-name.sluice.test" "# sluice-cluster end" >> /etc/hosts
  fi
  getent ahosts "$NAME" | grep -q 127.0.0.3 || fail "/etc/hosts: $NAME does not resolve to both brokers"
}

remove_hosts_block() {
  if grep -q '# sluice-cluster begin' /etc/hosts 2>/dev/null; then
    # /etc/hosts may be a bind mount: rewrite it in place rather than replace the file.
    local kept
    kept=$(sed '/# sluice-cluster begin/,/# sluice-cluster end/d' /etc/hosts)
    printf '%s\n' "$kept" > /etc/hosts
  fi
}

# -- configuration -------------------------------------------------------------------------------
write_confs() {
  local dist="$1" n ip port dir
  mkdir -p "$STATE/conf"
  cp "$dist/conf/zookeeper.conf" "$STATE/conf/zookeeper.conf"
  conf_set "$STATE/conf/zookeeper.conf" "dataDir=$STATE/zookeeper" "clientPort=2191" \
    "clientPortAddress=127.0.0.1" "admin.enableServer=false" \
    "metricsProvider.httpHost=127.0.0.1" "metricsProvider.httpPort=2194"
  for n in 1 2 3; do
    port=$(bookie_port "$n")
    dir="$STATE/bookie-$n"
    cp "$dist/conf/bookkeeper.conf" "$STATE/conf/bookkeeper-$n.conf"
    conf_set "$STATE/conf/bookkeeper-$n.conf" "bookiePort=$port" "advertisedAddress=127.0.0.1" \
      "allowLoopback=true" "useHostNameAsBookieID=false" \
      "journalDirectories=$dir/journal" "ledgerDirectories=$dir/ledgers" \
      "metadataServiceUri=metadata-store:zk:$ZK" \
      "httpServerEnabled=false" "enableStatistics=false" \
      "statsProviderClass=org.apache.bookkeeper.stats.NullStatsProvider" "listeningInterface=lo" \
      "journalFlushWhenQueueEmpty=true" \
      "dbStorage_writeCacheMaxSizeMb=32" "dbStorage_readAheadCacheMaxSizeMb=32" \
      "journalMaxSizeMB=256" "journalMaxBackups=1" \
      "diskUsageThreshold=0.99" "diskUsageWarnThreshold=0.98" "diskUsageLwmThreshold=0.98"
  # (journalMaxSizeMB/journalMaxBackups: the defaults, 2 GB files and 5 kept, let the state
  # kept between runs grow to 6.7 GB per bookie here, on a disk shared with builds.
  # diskUsage*: a bookie turns read-only when its disk is 95% used, counted as the share of
  # the file system's size not available to it; these machines' file systems report a size
  # far above what they can hold (252 GB, of which ~90 usable), so the default fired with
  # 13 GB still free, while the shared build cache grew, and every bookie went read-only in
  # the middle of a soak (2026-11-26). 99% leaves ~2.5 GB, as Pulsar's standalone.conf sets.)
  done
  # brokerDeleteInactiveTopicsEnabled=false: a topic's grants live and die with the topic, and
  # the broker deletes a topic without producers and subscriptions after about a minute
  # (measured: the set-up's grants of the text-completion topics were gone 2 minutes after
  # start, and the granted role was refused the topic's auto-creation). Topics provisioned
  # with grants must stay, as an operator granting per topic would configure it.
  for n in 1 2; do
    ip=$(broker_ip "$n")
    cp "$dist/conf/broker.conf" "$STATE/conf/broker-$n.conf"
    conf_set "$STATE/conf/broker-$n.conf" \
      "metadataStoreUrl=zk:$ZK" "configurationMetadataStoreUrl=zk:$ZK" \
      "bookkeeperMetadataServiceUri=metadata-store:zk:$ZK" \
      "clusterName=$CLUSTER" "bindAddress=$ip" "advertisedAddress=$ip" \
      "brokerServicePort=" "webServicePort=" \
      "brokerServicePortTls=6651" "webServicePortTls=8443" \
      "tlsCertificateFilePath=$STATE/pki/broker.pem" "tlsKeyFilePath=$STATE/pki/broker.key" \
      "tlsTrustCertsFilePath=$STATE/pki/ca.pem" "tlsRequireTrustedClientCertOnConnect=false" \
      "tlsAllowInsecureConnection=false" \
      "authenticationEnabled=true" \
      "authenticationProviders=org.apache.pulsar.broker.authentication.AuthenticationProviderToken" \
      "tokenSecretKey=file://$STATE/secret.key" \
      "authorizationEnabled=true" "superUserRoles=admin" \
      "authenticationRefreshCheckSeconds=10" \
      "brokerClientTlsEnabled=true" "brokerClientTrustCertsFilePath=$STATE/pki/ca.pem" \
      "brokerClientAuthenticationPlugin=org.apache.pulsar.client.impl.auth.AuthenticationToken" \
      "brokerClientAuthenticationParameters=file://$STATE/tokens/admin.token" \
      "managedLedgerDefaultEnsembleSize=$ENSEMBLE" \
      "managedLedgerDefaultWriteQuorum=$WRITE_QUORUM" \
      "managedLedgerDefaultAckQuorum=$ACK_QUORUM" \
      "managedLedgerNewEntriesCheckDelayInMillis=0" \
      "metadataStoreSessionTimeoutMillis=10000" \
      "functionsWorkerEnabled=false" "webSocketServiceEnabled=false" \
      "allowAutoTopicCreation=true" "allowAutoTopicCreationType=non-partitioned" \
      "brokerDeleteInactiveTopicsEnabled=false"
  done
  # The superuser's pulsar-admin (the `admin` command).
  printf '%s\n' "webServiceUrl=https://$NAME:8443" "brokerServiceUrl=pulsar+ssl://$NAME:6651" \
    "authPlugin=org.apache.pulsar.client.impl.auth.AuthenticationToken" \
    "authParams=file://$STATE/tokens/admin.token" "tlsTrustCertsFilePath=$STATE/pki/ca.pem" \
    "tlsAllowInsecureConnection=false" "tlsEnableHostnameVerification=true" \
    > "$STATE/conf/client.conf"
}

# -- processes -----------------------------------------------------------------------------------
pidfile() { echo "$STATE/$1.pid"; }

running() {
  local f
  f=$(pidfile "$1")
  [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null
}

# launch NAME COMMAND MEM: runs `bin/pulsar COMMAND` in the background with its own config.
launch() {
  local name="$1" command="$2" mem="$3" conf_var="$4" conf="$5" java_home dist
  java_home=$(find_java) || fail "no Java 21+ (JAVA_HOME or /usr/lib/jvm/*): Pulsar needs one"
  dist=$(bash "$HERE/pulsar.sh" dist)
  mkdir -p "$STATE/logs/$name"
  (
    cd "$dist"
    export JAVA_HOME="$java_home" PULSAR_LOG_DIR="$STATE/logs/$name"
    export PULSAR_MEM="$mem" BOOKIE_MEM="$mem" "$conf_var=$conf"
    # A pulsar_env.sh default pre-touches the whole heap; not worth the start-up time here.
    export PULSAR_GC="-XX:+UseZGC" BOOKIE_GC="-XX:+UseZGC"
    nohup bin/pulsar "$command" > "$STATE/logs/$name/stdout.log" 2>&1 &
    echo $! > "$(pidfile "$name")"
  )
}

# wait_for NAME WHAT CHECK...: waits until CHECK succeeds (its output discarded), or fails with
# the process's log (it exited, or READY_TIMEOUT passed).
wait_for() {
  local name="$1" what="$2" pid
  shift 2
  pid=$(cat "$(pidfile "$name")") || exit 1
  WAIT_INTERVAL=1 wait_ready "$READY_TIMEOUT" "$name: $what" "$pid" \
    "$STATE/logs/$name/stdout.log" quietly "$@" || exit 1
}

# admin_curl METHOD PATH [CURL ARGS...]: one admin request as the superuser over HTTPS; prints
# the body. Nothing fails silently: any refusal names the request, its HTTP status and the
# broker's message. A broker that has just become ready may still be taking over bundles and
# answer 5xx (or not at all) for a moment: those are retried for up to 60 s. A broker that does
# not own the topic's bundle redirects (307) to the owner: followed, with the token. A PUT
# answered 409 created nothing because the object exists: as good (a re-run set-up).
admin_curl() {
  local method="$1" path="$2" body code deadline=$((SECONDS + 60))
  shift 2
  body=$(mktemp)
  while :; do
    code=$(curl -s -L --location-trusted -m 30 -o "$body" -w '%{http_code}' -X "$method" \
      --cacert "$STATE/pki/ca.pem" -H "Authorization: Bearer $(cat "$STATE/tokens/admin.token")" \
      -H 'Content-Type: application/json' "$@" "https://$NAME:8443$path") || code=000
    case "$code" in
      2*) cat "$body"; rm -f "$body"; return 0 ;;
      409) if [ "$method" = PUT ]; then rm -f "$body"; return 0; fi ;;
      000|5*) if [ "$SECONDS" -lt "$deadline" ]; then sleep 1; continue; fi ;;
    esac
    log "$method $path: HTTP $code $(head -c 400 "$body" 2>/dev/null)"
    rm -f "$body"
    return 1
  done
}

# Pulsar 4.0 grants on a topic only once it exists: PUT creates (409 if it exists already).
admin_create() { admin_curl PUT "$@" >/dev/null; }

broker_ready() {
  curl -sf -m 5 --cacert "$STATE/pki/ca.pem" \
    -H "Authorization: Bearer $(cat "$STATE/tokens/admin.token")" \
    "https://$(broker_ip "$1"):8443/admin/v2/brokers/ready" | grep -q ok
}

# One of ZooKeeper's four-letter commands (bin/pulsar allows them all), without a JVM.
zk_command() { echo "$1" | timeout 3 bash -c "exec 3<>/dev/tcp/127.0.0.1/2191; cat >&3; cat <&3"; }

zk_ready() { zk_command ruok | grep -q imok; }

# The ZooKeeper session holding bookie N's registration, the ephemeral node
# /ledgers/available/HOST:PORT (a read-only bookie registers under .../readonly/ instead),
# read from `dump`. Not the brokers' /admin/v2/bookies/all: that lists every bookie that ever
# registered a cookie, a dead one too. Empty when the bookie is not registered.
bookie_session() {
  zk_command dump | awk -v node="/ledgers/available/127.0.0.1:$(bookie_port "$1")" \
    '/^0x/ { session = $1 } $1 == node { print session }' | tr -d ':'
}

# session_other_than N SESSION: bookie N's registration is not (or no longer) SESSION's.
session_other_than() { [ "$(bookie_session "$1")" != "$2" ]; }

# A bookie is writable once registered by a live process. A SIGKILLed bookie's node outlives
# it until its ZooKeeper session expires: bookie_registered N OLD_SESSION waits for another.
bookie_registered() {
  local session
  running "bookie-$1" || return 1
  session=$(bookie_session "$1")
  [ -n "$session" ] && [ "$session" != "${2:-}" ]
}

start_zookeeper() {
  running zookeeper && return 0
  launch zookeeper zookeeper "-Xms128m -Xmx128m" PULSAR_ZK_CONF "$STATE/conf/zookeeper.conf"
  wait_for zookeeper "answering" zk_ready
}

initialize_metadata() {
  [ -f "$STATE/.initialized" ] && return 0
  log "initialising the cluster's metadata"
  local java_home dist
  java_home=$(find_java)
  dist=$(bash "$HERE/pulsar.sh" dist)
  (
    cd "$dist"
    JAVA_HOME="$java_home" PULSAR_MEM="-Xmx256m" PULSAR_LOG_DIR="$STATE/logs/init" \
      bin/pulsar initialize-cluster-metadata --cluster "$CLUSTER" \
      --metadata-store "zk:$ZK" --configuration-metadata-store "zk:$ZK" \
      --web-service-url "https://$NAME:8443" --web-service-url-tls "https://$NAME:8443" \
      --broker-service-url "pulsar+ssl://$NAME:6651" \
      --broker-service-url-tls "pulsar+ssl://$NAME:6651" \
      > "$STATE/logs/init.log" 2>&1
  ) || { tail -n 40 "$STATE/logs/init.log" >&2; fail "initialize-cluster-metadata failed"; }
  touch "$STATE/.initialized"
}

start_bookie() {
  local n="$1"
  running "bookie-$n" && return 0
  mkdir -p "$STATE/bookie-$n"
  launch "bookie-$n" bookie "-Xms$BOOKIE_HEAP -Xmx$BOOKIE_HEAP -XX:MaxDirectMemorySize=$BOOKIE_HEAP" \
    PULSAR_BOOKKEEPER_CONF "$STATE/conf/bookkeeper-$n.conf"
}

start_broker() {
  local n="$1"
  running "broker-$n" && return 0
  launch "broker-$n" broker "-Xms$BROKER_HEAP -Xmx$BROKER_HEAP -XX:MaxDirectMemorySize=$BROKER_HEAP" \
    PULSAR_BROKER_CONF "$STATE/conf/broker-$n.conf"
}

stop_process() {
  local name="$1" signal="${2:-TERM}" pid f
  f=$(pidfile "$name")
  [ -f "$f" ] || return 0
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill -"$signal" "$pid" 2>/dev/null || true
    wait_gone 60 "$name (pid $pid) to exit on SIG$signal" "$pid" || true
    kill -9 "$pid" 2>/dev/null || true
    # Still there after 30 s (stuck in the kernel): keep its pid file, so that no start
    # runs beside it, and say so.
    WAIT_INTERVAL=0.2 wait_gone 30 "$name (pid $pid) to exit on SIGKILL" "$pid" || {
      log "$name (pid $pid) outlived SIGKILL by 30 s; its pid file $f stays"
      return 1
    }
  fi
  rm -f "$f"
}

# Idempotent (409 for what exists), so it runs at every start that is not a reuse: grants
# lost meanwhile come back.
set_up_tenants() {
  admin_create /admin/v2/tenants/tg -d "{\"adminRoles\":[],\"allowedClusters\":[\"$CLUSTER\"]}"
  local ns
  for ns in request response notify flow; do
    admin_create "/admin/v2/namespaces/tg/$ns"
  done
  grant_roles tg
  touch "$STATE/.set-up"
}

# grant_roles TS: each role's least-privilege grants on the default topics of topicspace TS
# (docs/production-pulsar.md#roles-and-grants, the table there; services/cli/tests/cluster.rs
# checks that the agent's role is refused the rest). Pulsar keeps one set of actions per role
# and topic: a grant replaces the last, so each line names the role's whole set there.
grant_roles() {
  local ts="$1" service
  # Each processor takes its requests and cancels and publishes its answers; the gateway
  # publishes requests and cancels and reads the answers of every service.
  for service in text-completion prompt; do
    grant "sluice-$service" consume "persistent://$ts/request/$service"
  done
  for service in text-completion prompt agent; do
    grant "sluice-$service" consume "persistent://$ts/notify/$service-cancel"
    grant "sluice-$service" produce "persistent://$ts/response/$service"
    grant sluice-gateway produce "persistent://$ts/request/$service"
    grant sluice-gateway produce "persistent://$ts/notify/$service-cancel"
    grant sluice-gateway consume "persistent://$ts/response/$service"
  done
  # The agent hands each next step of a dialog on over its own request topic.
  grant sluice-agent consume,produce "persistent://$ts/request/agent"
  # The supervisor's fan-in (docs/agent.md#the-supervisor-and-its-fan-in): registrations and
  # subagents' completions, held by one replica's joiner at a time.
  grant sluice-agent consume,produce "persistent://$ts/request/agent-fanin"
  # The gateways' shared limit state (docs/gateway.md#limits-across-replicas): theirs alone.
  grant sluice-gateway consume,produce "persistent://$ts/response/gateway-limits"
  # The usage ledger (docs/text-completion.md#usage-ledger): text-completion's alone.
  grant sluice-text-completion produce "persistent://$ts/response/usage"
  # Prompt and agent call text-completion as the gateway does, and the agent calls prompt
  # (its reasoning, its prompt and text-completion tools).
  for service in prompt agent; do
    grant "sluice-$service" produce "persistent://$ts/request/text-completion"
    grant "sluice-$service" produce "persistent://$ts/notify/text-completion-cancel"
    grant "sluice-$service" consume "persistent://$ts/response/text-completion"
  done
  grant sluice-agent produce "persistent://$ts/request/prompt"
  grant sluice-agent produce "persistent://$ts/notify/prompt-cancel"
  grant sluice-agent consume "persistent://$ts/response/prompt"
}

# Pulsar 4.0 grants on a topic only once the topic exists (404 before): create it first, as
# an operator would with `pulsar-admin topics create` (409 if it exists, partitioned or not).
grant() {
  local role="$1" actions="$2" topic="$3" json
  json=$(printf '%s' "$actions" | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read().split(",")))')
  admin_create "/admin/v2/${topic/:\/\//\/}"
  # The other broker may not see a topic created a moment ago (404 from its metadata cache).
  local attempt
  for attempt in 1 2 3 4 5; do
    admin_curl POST "/admin/v2/${topic/:\/\//\/}/permissions/$role" -d "$json" >/dev/null && return 0
    sleep "$attempt"
  done
  return 1
}

revoke() {
  admin_curl DELETE "/admin/v2/${2/:\/\//\/}/permissions/$1" >/dev/null
}

cluster_ready() {
  broker_ready 1 && broker_ready 2 && bookie_registered 1 && bookie_registered 2 && bookie_registered 3
}

start() {
  if cluster_ready 2>/dev/null && [ -f "$STATE/.set-up" ]; then
    log "already serving (reused): pulsar+ssl://$NAME:6651"
    return 0
  fi
  local began=$SECONDS dist n
  dist=$(bash "$HERE/pulsar.sh" dist)
  mkdir -p "$STATE"
  hosts_block
  make_pki
  make_tokens
  write_confs "$dist"
  start_zookeeper
  initialize_metadata
  # On fresh metadata, bookies starting together race to create the auditor's
  # /ledgers/underreplication/LAYOUT and the losers exit ("BadVersion", seen here): the first
  # bookie registers alone, then the others start in parallel.
  if [ ! -f "$STATE/.bookies-formatted" ]; then
    start_bookie 1
    wait_for bookie-1 "registered" bookie_registered 1
    touch "$STATE/.bookies-formatted"
  fi
  for n in 1 2 3; do start_bookie "$n"; done
  for n in 1 2 3; do wait_for "bookie-$n" "registered" bookie_registered "$n"; done
  for n in 1 2; do start_broker "$n"; done
  for n in 1 2; do wait_for "broker-$n" "ready" broker_ready "$n"; done
  set_up_tenants
  log "ready after $((SECONDS - began))s: pulsar+ssl://$NAME:6651, https://$NAME:8443 (state $STATE)"
}

stop() {
  local n
  for n in 1 2; do stop_process "broker-$n"; done
  for n in 1 2 3; do stop_process "bookie-$n"; done
  stop_process zookeeper
  log "stopped"
}

# The data of ZooKeeper and the bookies go; the CA, certificates, key and tokens stay (nothing
# in them can be left half-written by a crash: each set is marked complete only once whole).
start_fresh() {
  stop
  rm -rf "$STATE/zookeeper" "$STATE"/bookie-* "$STATE/logs" \
    "$STATE/.initialized" "$STATE/.bookies-formatted" "$STATE/.set-up"
  start
}

case "${1:-}" in
  start) start ;;
  start-fresh) start_fresh ;;
  stop) stop ;;
  wipe)
    stop
    rm -rf "$STATE"
    remove_hosts_block
    ;;
  status) cluster_ready || exit 1 ;;
  env)
    printf 'export %s\n' \
      "SLUICE_CLUSTER_URL=pulsar+ssl://$NAME:6651" \
      "SLUICE_CLUSTER_ADMIN_URL=https://$NAME:8443" \
      "SLUICE_CLUSTER_BROKERS='pulsar+ssl://127.0.0.2:6651 pulsar+ssl://127.0.0.3:6651'" \
      "SLUICE_CLUSTER_BROKER_ADMIN_URLS='https://127.0.0.2:8443 https://127.0.0.3:8443'" \
      "SLUICE_CLUSTER_CA=$STATE/pki/ca.pem" \
      "SLUICE_CLUSTER_UNTRUSTED_CA=$STATE/pki/untrusted-ca.pem" \
      "SLUICE_CLUSTER_TOKENS=$STATE/tokens" \
      "SLUICE_CLUSTER_SECRET_KEY=$STATE/secret.key" \
      "SLUICE_CLUSTER_SCRIPT=$SCRIPT"
    ;;
  kill-broker) stop_process "broker-${2:?broker 1 or 2}" KILL; log "broker $2 killed" ;;
  stop-broker) stop_process "broker-${2:?broker 1 or 2}" TERM; log "broker $2 stopped" ;;
  start-broker)
    start_broker "${2:?broker 1 or 2}"
    wait_for "broker-$2" "ready" broker_ready "$2"
    log "broker $2 ready"
    ;;
  restart-broker)
    stop_process "broker-${2:?broker 1 or 2}" TERM
    start_broker "$2"
    wait_for "broker-$2" "ready" broker_ready "$2"
    log "broker $2 restarted"
    ;;
  kill-bookie) stop_process "bookie-${2:?bookie 1 to 3}" KILL; log "bookie $2 killed" ;;
  start-bookie)
    # A SIGKILLed bookie's registration (an ephemeral node, also a lock) outlives it until its
    # ZooKeeper session expires (zkTimeout, 30 s). A bookie started before then finds the lock
    # taken and runs without ever registering (seen here: not registered after 300 s), so the
    # start waits for the old registration to go.
    stale=""
    running "bookie-${2:?bookie 1 to 3}" || stale=$(bookie_session "$2")
    if [ -n "$stale" ]; then
      WAIT_INTERVAL=1 wait_until 60 "bookie $2's stale registration to expire" session_other_than "$2" "$stale" ||
        fail "bookie $2: the registration of the killed process (session $stale) did not expire in 60 s"
    fi
    start_bookie "$2"
    wait_for "bookie-$2" "registered" bookie_registered "$2" "$stale"
    log "bookie $2 registered"
    ;;
  unload) admin_curl PUT "/admin/v2/namespaces/${2:?tenant/namespace}/unload" >/dev/null ;;
  owner)
    topic="${2:?topic}"
    admin_curl GET "/lookup/v2/topic/${topic/:\/\//\/}" |
      python3 -c 'import json,sys; print(json.load(sys.stdin)["brokerUrlTls"])'
    ;;
  grant) grant "${2:?role}" "${3:?actions}" "${4:?topic}" ;;
  grant-roles) grant_roles "${2:?topicspace}" ;;
  revoke) revoke "${2:?role}" "${3:?topic}" ;;
  admin)
    shift
    dist=$(bash "$HERE/pulsar.sh" dist)
    JAVA_HOME=$(find_java) PULSAR_CLIENT_CONF="$STATE/conf/client.conf" "$dist/bin/pulsar-admin" "$@"
    ;;
  *)
    sed -n '2,/^set -euo/p' "$SCRIPT" | sed '$d' | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
