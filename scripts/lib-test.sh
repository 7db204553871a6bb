#!/usr/bin/env bash
# Checks scripts/lib.sh (log, fail, wait_until, wait_gone, wait_ready, free_port) under the options every
# script runs with (`set -euo pipefail`, and `set -E` with an ERR trap as the cluster scripts
# have). About 10 s; no network, no broker. Prints "lib.sh: all checks passed" or exits non-zero.
#
#   bash scripts/lib-test.sh
set -eEuo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
LOG_TAG="lib-test"
LIB="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"
trapped=0
trap 'trapped=$((trapped + 1))' ERR

failures=0
check() { # what, then the outcome: ok or anything else
  if [ "$2" = ok ]; then
    printf '  ok   %s\n' "$1" >&2
  else
    printf '  FAIL %s: %s\n' "$1" "$2" >&2
    failures=$((failures + 1))
  fi
}
# ms since the epoch, for durations finer than $SECONDS.
now_ms() { date +%s%3N; }
# outcome: ok when "$1" (a status) equals "$2", when the elapsed ms "$3" lies in [$4, $5].
outcome() {
  if [ "$1" != "$2" ]; then echo "returned $1, not $2"
  elif [ "$3" -lt "$4" ] || [ "$3" -gt "$5" ]; then echo "took $3 ms, not $4-$5 ms"
  else echo ok
  fi
}

# log: the tag, the message, on stderr only.
out=$(log "hello  world" 2>/dev/null)
err=$(log "hello  world" 2>&1 >/dev/null)
[ -z "$out" ] && [ "$err" = "[lib-test] hello  world" ] && r=ok || r="stdout '$out', stderr '$err'"
check "log prints [\$LOG_TAG] MESSAGE on stderr" "$r"
err=$(unset LOG_TAG; log x 2>&1)
[ "$err" = "[lib-test.sh] x" ] && r=ok || r="got '$err'"
check "log without LOG_TAG tags with the script's name (set -u)" "$r"

# fail: logs, exits 1 (the subshell stands for a script).
rc=0; err=$( (fail "it broke"; echo "still running" >&2) 2>&1) || rc=$?
[ "$rc" = 1 ] && [ "$err" = "[lib-test] it broke" ] && r=ok || r="exit $rc, output '$err'"
check "fail logs and exits 1" "$r"

# wait_until: a command that never succeeds, under set -e, within its timeout.
t=$(now_ms); rc=0; err=$(wait_until 2 "never" false 2>&1) || rc=$?
check "wait_until 2 never false: returns 1 after 2 s or a little more" "$(outcome "$rc" 1 $(($(now_ms) - t)) 1900 6000)"
[ "$err" = "[lib-test] timed out after 2 s waiting for never" ] && r=ok || r="logged '$err'"
check "wait_until logs the timeout" "$r"

t=$(now_ms); rc=0; wait_until 5 "true" true || rc=$?
check "wait_until 5 true true: returns 0 at once" "$(outcome "$rc" 0 $(($(now_ms) - t)) 0 1500)"

# A condition that becomes true after ~1 s (a file a background job makes).
flag=$(mktemp -u "${TMPDIR:-/tmp}/lib-test.XXXXXX")
(sleep 1; touch "$flag") &
# Called bare, as a script would before its next line: a false COMMAND must not stop it.
t=$(now_ms); rc=0; wait_until 10 "the flag" test -e "$flag"
check "wait_until: a condition true after 1 s returns 0 after ~1 s" "$(outcome "$rc" 0 $(($(now_ms) - t)) 900 4000)"
rm -f "$flag"
wait

# Arguments are passed as given, never evaluated: spaces, globs and $ stay literal.
got=""
record() { got="$*|$#"; }
# shellcheck disable=SC2016  # the $(...) is meant literally
wait_until 1 "arguments" record 'a b' '*' '$(echo no)'
# shellcheck disable=SC2016
[ "$got" = 'a b * $(echo no)|3' ] && r=ok || r="got '$got'"
check "wait_until passes COMMAND's arguments as given (no eval)" "$r"

# WAIT_INTERVAL: four tries 0.1 s apart take well under the default's 1.5 s.
tries=0
fourth() { tries=$((tries + 1)); [ "$tries" -ge 4 ]; }
t=$(now_ms); rc=0; WAIT_INTERVAL=0.1 wait_until 5 "the fourth try" fourth
check "WAIT_INTERVAL=0.1: four tries in ~0.3 s (the default interval would take 1.5 s)" "$(outcome "$rc" 0 $(($(now_ms) - t)) 250 1400)"
[ "${WAIT_INTERVAL:-unset}" = unset ] && r=ok || r="WAIT_INTERVAL=$WAIT_INTERVAL after the call"
check "WAIT_INTERVAL=... wait_until leaves WAIT_INTERVAL unset" "$r"

# A failing function as COMMAND, the call bare: set -e does not stop the script (it would
# have exited above) and the ERR trap does not fire, for the failed tries or inside COMMAND.
fails_twice() { false; echo "set -e is off in a condition" >/dev/null; tries=$((tries + 1)); [ "$tries" -ge 3 ]; }
tries=0; trapped=0
WAIT_INTERVAL=0.1 wait_until 5 "the third try" fails_twice
[ "$tries" = 3 ] && [ "$trapped" = 0 ] && r=ok || r="$tries tries, ERR trap fired $trapped times"
check "a failing COMMAND, the call bare, trips neither set -e nor the ERR trap" "$r"

# Usage errors return 2 and say so.
rc=0; err=$(wait_until soon "x" true 2>&1) || rc=$?
[ "$rc" = 2 ] && [[ "$err" == *"whole number"* ]] && r=ok || r="returned $rc: '$err'"
check "wait_until with a bad SECONDS returns 2" "$r"
rc=0; err=$(wait_until 3 "x" 2>&1) || rc=$?
[ "$rc" = 2 ] && r=ok || r="returned $rc: '$err'"
check "wait_until without COMMAND returns 2" "$r"

# wait_gone: a child that exits after 1 s; one that outlives the timeout.
sleep 1 &
pid=$!
t=$(now_ms); rc=0; wait_gone 10 "sleep 1" "$pid" || rc=$?
check "wait_gone on 'sleep 1 &' returns 0 after ~1 s" "$(outcome "$rc" 0 $(($(now_ms) - t)) 700 4000)"
sleep 30 &
pid=$!
t=$(now_ms); rc=0; err=$(wait_gone 1 "sleep 30" "$pid" 2>&1) || rc=$?
check "wait_gone 1 on 'sleep 30 &' returns 1 after 1-2 s" "$(outcome "$rc" 1 $(($(now_ms) - t)) 900 4500)"
[ "$err" = "[lib-test] timed out after 1 s waiting for sleep 30" ] && r=ok || r="logged '$err'"
check "wait_gone logs the timeout" "$r"
kill "$pid"; wait "$pid" 2>/dev/null || true
rc=0; wait_gone 1 "a process that is gone" "$pid" || rc=$?
check "wait_gone on a pid that is gone returns 0" "$(outcome "$rc" 0 0 0 0)"
rc=0; err=$(wait_gone 1 "nothing" "" 2>&1) || rc=$?
[ "$rc" = 2 ] && r=ok || r="returned $rc: '$err'"
check "wait_gone without PID returns 2" "$r"

# wait_ready: ready while the process lives; the process exits first; a timeout; usage.
logf=$(mktemp "${TMPDIR:-/tmp}/lib-test.XXXXXX")
printf 'line %s\n' $(seq 1 50) >"$logf"
flag=$(mktemp -u "${TMPDIR:-/tmp}/lib-test.XXXXXX")
sleep 30 &
pid=$!
(sleep 1; touch "$flag") &
t=$(now_ms); rc=0; err=$(wait_ready 10 "the flag" "$pid" "$logf" test -e "$flag" 2>&1) || rc=$?
check "wait_ready: ready after ~1 s while the process lives returns 0, logs nothing" "$(outcome "$rc" 0 $(($(now_ms) - t)) 700 4000)"
[ -z "$err" ] && r=ok || r="logged '$err'"
check "wait_ready logs nothing when ready" "$r"
rm -f "$flag"
sleep 1 &
gone=$!
t=$(now_ms); rc=0; err=$(wait_ready 20 "never ready" "$pid $gone" "$logf" false 2>&1) || rc=$?
check "wait_ready: one of two processes exits after 1 s: returns 1 then, not at the timeout" "$(outcome "$rc" 1 $(($(now_ms) - t)) 700 5000)"
[[ "$err" == "[lib-test] never ready: process $gone exited"$'\n'"[lib-test] the last lines of $logf:"$'\n'"line 11"$'\n'* ]] &&
  [[ "$err" == *$'\n'"line 50" ]] && r=ok || r="logged '$err'"
check "wait_ready names the process that exited and shows the log's last 40 lines" "$r"
t=$(now_ms); rc=0; err=$(wait_ready 1 "slow" "$pid" "" false 2>&1) || rc=$?
check "wait_ready 1 with a live process that never gets ready returns 1 after 1-2 s" "$(outcome "$rc" 1 $(($(now_ms) - t)) 900 4500)"
[ "$err" = "[lib-test] timed out after 1 s waiting for slow" ] && r=ok || r="logged '$err'"
check "wait_ready's timeout without a log file logs the timeout only" "$r"
rc=0; err=$(wait_ready 1 "nothing" "" "" true 2>&1) || rc=$?
[ "$rc" = 2 ] && r=ok || r="returned $rc: '$err'"
check "wait_ready without PID returns 2" "$r"
rc=0; err=$(wait_ready 1 "x" "$pid" "" 2>&1) || rc=$?
[ "$rc" = 2 ] && r=ok || r="returned $rc: '$err'"
check "wait_ready without COMMAND returns 2" "$r"
kill "$pid"; wait "$pid" 2>/dev/null || true
wait
rm -f "$logf"

# free_port: a port number that can be bound.
port=$(free_port)
[[ "$port" =~ ^[0-9]+$ ]] && python3 -c 'import socket, sys; socket.socket().bind(("127.0.0.1", int(sys.argv[1])))' "$port" &&
  r=ok || r="got '$port'"
check "free_port prints a bindable port on 127.0.0.1" "$r"

# Sourced twice: a script's own fail stays; run instead of sourced: refused.
r=$(bash -c '. "$1"; fail() { echo mine; }; . "$1"; fail' _ "$LIB" 2>&1) || true
[ "$r" = mine ] && r=ok || r="got '$r'"
check "sourcing lib.sh again keeps a script's own fail" "$r"
rc=0; bash "$LIB" 2>/dev/null || rc=$?
[ "$rc" = 2 ] && r=ok || r="exit $rc"
check "running lib.sh instead of sourcing it exits 2" "$r"

[ "$trapped" = 0 ] && r=ok || r="fired $trapped times"
check "the ERR trap fired for nothing since it was last reset" "$r"
if [ "$failures" -ne 0 ]; then
  echo "lib.sh: $failures check(s) failed" >&2
  exit 1
fi
echo "lib.sh: all checks passed"
