#!/usr/bin/env bash
# Runs a real Apache Pulsar standalone broker on loopback, for tests and local use.
#
#   deploy/pulsar/pulsar.sh start     start (or reuse) a broker and wait until it serves
#   deploy/pulsar/pulsar.sh start-fresh  stop, delete its data, start
#   deploy/pulsar/pulsar.sh stop      stop the broker this script started
#   deploy/pulsar/pulsar.sh restart   stop then start, keeping its data
#   deploy/pulsar/pulsar.sh kill      SIGKILL the broker (a crash: no clean shutdown); `start` recovers it
#   deploy/pulsar/pulsar.sh status    exit 0 when the broker answers
#   deploy/pulsar/pulsar.sh env       print PULSAR_URL and PULSAR_ADMIN_URL for this broker
#   deploy/pulsar/pulsar.sh wipe      stop and delete its data
#   deploy/pulsar/pulsar.sh dist      fetch the distribution (once) and print its directory
#   deploy/pulsar/pulsar.sh java      print the JAVA_HOME of a Java 21+ (cluster.sh uses it)
#
# Pulsar comes from Maven Central through Maven (cached in ~/.m2), unpacked once under
# $SLUICE_CACHE (default ~/.cache/sluice), outside the clone. A second broker for tests
# that restart their broker runs beside the first with other ports and its own state:
#   PULSAR_PORT=6652 PULSAR_HTTP_PORT=8082 PULSAR_BK_PORT=3183 deploy/pulsar/pulsar.sh start
#
# Settings (environment): SLUICE_PULSAR_VERSION (4.0.8), PULSAR_PORT (6650),
# PULSAR_HTTP_PORT (8080), PULSAR_BK_PORT (3181), PULSAR_HEAP (512m),
# PULSAR_STATE_DIR (default $SLUICE_CACHE/pulsar-state/$PULSAR_PORT),
# PULSAR_READY_TIMEOUT (seconds, 240), PULSAR_EXTRA_CONF (lines appended to standalone.conf),
# PULSAR_HOST (127.0.0.1: the address it binds, advertises and is reached at; the Kubernetes
# test gives the node bridge's 10.244.0.1, which pods reach).
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"

VERSION="${SLUICE_PULSAR_VERSION:-4.0.8}"
CACHE="${SLUICE_CACHE:-$HOME/.cache/sluice}"
PORT="${PULSAR_PORT:-6650}"
HTTP_PORT="${PULSAR_HTTP_PORT:-8080}"
BK_PORT="${PULSAR_BK_PORT:-3181}"
HEAP="${PULSAR_HEAP:-512m}"
STATE="${PULSAR_STATE_DIR:-$CACHE/pulsar-state/$PORT}"
READY_TIMEOUT="${PULSAR_READY_TIMEOUT:-240}"
DIST="$CACHE/pulsar/apache-pulsar-$VERSION"
HOST="${PULSAR_HOST:-127.0.0.1}"
ADMIN="http://$HOST:$HTTP_PORT"

LOG_TAG="pulsar:$PORT"

ready() {
  # Serving once the standalone's default namespace exists: topics can be used.
  curl -sf -m 5 "$ADMIN/admin/v2/namespaces/public" 2>/dev/null | grep -q 'public/default'
}

# Pulsar 4.x brokers want Java 21 or newer. Prefer JAVA_HOME, then any JDK under /usr/lib/jvm.
find_java() {
  local candidates=() j v
  [ -n "${JAVA_HOME:-}" ] && candidates+=("$JAVA_HOME")
  for j in /usr/lib/jvm/*; do [ -x "$j/bin/java" ] && candidates+=("$j"); done
  for j in "${candidates[@]}"; do
    v=$("$j/bin/java" -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1)
    if [ -n "$v" ] && [ "$v" -ge 21 ]; then echo "$j"; return 0; fi
  done
  return 1
}

ensure_dist() {
  [ -x "$DIST/bin/pulsar" ] && return 0
  if ! command -v mvn >/dev/null 2>&1; then
    log "installing Maven"
    apt-get update -qq && apt-get install -y -qq maven >/dev/null
  fi
  local dl="$CACHE/pulsar-dl"
  mkdir -p "$dl" "$CACHE/pulsar"
  log "fetching Apache Pulsar $VERSION through Maven (once; cached)"
  mvn -q -B dependency:copy \
    -Dartifact="org.apache.pulsar:pulsar-server-distribution:$VERSION:tar.gz:bin" \
    -DoutputDirectory="$dl" >&2
  local tmp="$CACHE/pulsar/.unpack.$$"
  rm -rf "$tmp" && mkdir -p "$tmp"
  tar xzf "$dl/pulsar-server-distribution-$VERSION-bin.tar.gz" -C "$tmp"
  # Move into place atomically, so a half-unpacked tree is never taken for a distribution.
  mv "$tmp/apache-pulsar-$VERSION" "$DIST" 2>/dev/null || [ -x "$DIST/bin/pulsar" ]
  rm -rf "$tmp"
}

# managedLedgerNewEntriesCheckDelayInMillis=0: by default the broker looks for new entries
# on a tailing cursor every 10 ms, adding ~5 ms per persistent hop (two per request/response
# round trip); Pulsar documents 0 for latency-sensitive consumers. Measured in bench/.
write_conf() {
  mkdir -p "$STATE/logs"
  sed -e "s/^brokerServicePort=.*/brokerServicePort=$PORT/" \
      -e "s/^webServicePort=.*/webServicePort=$HTTP_PORT/" \
      -e "s/^bindAddress=.*/bindAddress=$HOST/" \
      -e "s/^advertisedAddress=.*/advertisedAddress=$HOST/" \
      -e "s/^webSocketServiceEnabled=.*/webSocketServiceEnabled=false/" \
      -e "s/^managedLedgerNewEntriesCheckDelayInMillis=.*/managedLedgerNewEntriesCheckDelayInMillis=0/" \
      "$DIST/conf/standalone.conf" > "$STATE/standalone.conf"
  # The standalone's bookie reads this file too. Flush the journal as soon as its queue is
  # empty instead of waiting out the group-commit window: lower latency at low load.
  printf "\njournalFlushWhenQueueEmpty=true\n" >> "$STATE/standalone.conf"
  # Extra settings, one `key=value` per line, e.g. a bookie's disk thresholds for the
  # full-disk test. Each replaces the key's line: the broker's config reader takes a key
  # given twice as a list and uses its FIRST value.
  local line key
  while IFS= read -r line; do
    [ -n "$line" ] || continue
    key="${line%%=*}"
    sed -i "/^${key}=/d" "$STATE/standalone.conf"
    printf "%s\n" "$line" >> "$STATE/standalone.conf"
  done <<< "${PULSAR_EXTRA_CONF:-}"
}

start() {
  if ready; then
    log "already serving on $PORT (reused)"
    return 0
  fi
  local java_home
  if ! java_home=$(find_java); then
    log "no Java 21+ found (JAVA_HOME or /usr/lib/jvm/*): Pulsar $VERSION needs one"
    exit 1
  fi
  ensure_dist
  write_conf
  log "starting (state $STATE, Java $java_home)"
  (
    cd "$DIST"
    export JAVA_HOME="$java_home"
    export PULSAR_MEM="-Xms$HEAP -Xmx$HEAP -XX:MaxDirectMemorySize=$HEAP"
    export PULSAR_LOG_DIR="$STATE/logs"
    export PULSAR_STANDALONE_CONF="$STATE/standalone.conf"
    nohup bin/pulsar standalone -nfw -nss -a "$HOST" \
      --bookkeeper-port "$BK_PORT" \
      --bookkeeper-dir "$STATE/bookkeeper" \
      --metadata-dir "$STATE/metadata" \
      > "$STATE/logs/stdout.log" 2>&1 &
    echo $! > "$STATE/pid"
  )
  local t0=$SECONDS
  WAIT_INTERVAL=1 wait_ready "$READY_TIMEOUT" "the broker's start-up" "$(cat "$STATE/pid")" \
    "$STATE/logs/stdout.log" ready || exit 1
  log "ready after $((SECONDS - t0))s: pulsar://$HOST:$PORT, admin $ADMIN"
}

stop() {
  local pid
  if [ -f "$STATE/pid" ]; then
    pid=$(cat "$STATE/pid")
    if kill -0 "$pid" 2>/dev/null; then
      kill "$pid"
      WAIT_INTERVAL=1 wait_gone 60 "the broker (pid $pid) to exit on SIGTERM" "$pid" || true
      kill -9 "$pid" 2>/dev/null || true
      log "stopped"
    fi
    rm -f "$STATE/pid"
  fi
}

case "${1:-}" in
  start) start ;;
  start-fresh) stop; rm -rf "$STATE"; start ;;
  stop) stop ;;
  restart) stop; start ;;
  kill)
    # SIGKILL, as a crash or an OOM kill: no clean shutdown of the broker or its bookie.
    if [ -f "$STATE/pid" ] && kill -0 "$(cat "$STATE/pid")" 2>/dev/null; then
      pid=$(cat "$STATE/pid")
      kill -9 "$pid"
      # Still there after 30 s (stuck in the kernel): keep the pid file, so that no start
      # runs beside it, and say so.
      WAIT_INTERVAL=0.2 wait_gone 30 "the broker (pid $pid) to exit on SIGKILL" "$pid" ||
        fail "the broker (pid $pid) outlived SIGKILL by 30 s; its pid file stays in $STATE"
      log "killed (SIGKILL)"
    fi
    rm -f "$STATE/pid"
    ;;
  status) ready ;;
  env) printf 'PULSAR_URL=pulsar://%s:%s\nPULSAR_ADMIN_URL=%s\n' "$HOST" "$PORT" "$ADMIN" ;;
  wipe) stop; rm -rf "$STATE" ;;
  dist) ensure_dist; echo "$DIST" ;;
  java) find_java ;;
  *) echo "usage: $0 start|start-fresh|stop|restart|status|env|wipe|dist|java" >&2; exit 2 ;;
esac
