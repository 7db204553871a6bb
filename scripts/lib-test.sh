#!/usr/bin/env bash
# Checks scripts/lib.sh (log, fail, wait_until, wait_gone, wait_ready, free_port) under the options every
# script runs with (`set -euo pipefail`, and `set -E` with an ERR trap as the cluster scripts
# have). A few seconds; no network, no broker. No check judges the machine's speed: the waits'
# tries and intervals are counted (on a virtual clock where a check needs many), and the real
# clock gives only lower bounds (a wait never gives up early) under a hang guard. Prints
# "lib.sh: all checks passed" or exits non-zero.
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
# ms since the epoch, for the real-clock checks' lower bounds.
now_ms() { date +%s%3N; }
# outcome: ok when "$1" (a status) equals "$2", when the elapsed ms "$3" is at least "$4" (what
# the call promises: it does not give up before its timeout) and at most "$5", a hang guard
# only: no check judges how fast this machine is (a busy machine stretches every step).
outcome() {
  if [ "$1" != "$2" ]; then echo "returned $1, not $2"
  elif [ "$3" -lt "$4" ] || [ "$3" -gt "$5" ]; then echo "took $3 ms, not $4-$5 ms"
  else echo ok
  fi
}
# A hang guard for the real-clock checks: far above anything they wait for.
HANG_MS=60000

# Every wait between tries goes through `sleep`: this one records its argument in `slept`, runs
# ON_SLEEP (when set) at the ON_SLEEP_AT-th interval, and then either really sleeps or, with
# VIRTUAL_CLOCK set, advances $SECONDS (the clock wait_until reads) by VIRTUAL_CLOCK seconds
# and returns at once. So the checks below count tries and intervals, and make a process exit
# at a given try, instead of timing a background job against the wall clock: they pass or fail
# the same on a busy machine. The virtual step is 100 s, far above the seconds by which the real
# clock can also move during a check (a few milliseconds of work), so the tries fall on the same side of a timeout
# however busy the machine is. Background processes are `command sleep`: the real binary, so
# that $! is the process itself.
slept=()
ON_SLEEP_AT=0 ON_SLEEP="" VIRTUAL_CLOCK=""
sleep() {
  slept+=("$1")
  if [ -n "$ON_SLEEP" ] && [ "${#slept[@]}" -eq "$ON_SLEEP_AT" ]; then eval "$ON_SLEEP"; fi
  if [ -n "$VIRTUAL_CLOCK" ]; then
    SECONDS=$((SECONDS + VIRTUAL_CLOCK))
  else
    command sleep "$1"
  fi
}
# reset_sleeps: forget the recorded intervals and hooks, back to the real clock.
reset_sleeps() { slept=(); ON_SLEEP_AT=0 ON_SLEEP="" VIRTUAL_CLOCK=""; }
errf=$(mktemp "${TMPDIR:-/tmp}/lib-test.XXXXXX")

# wait_until on the real clock: a command that never succeeds, under set -e: gives up after its
# timeout, never before (bash's $SECONDS counts whole seconds, so "more than 2" is past 2 s).
reset_sleeps
t=$(now_ms); rc=0; wait_until 2 "never" false 2>"$errf" || rc=$?
check "wait_until 2 never false: returns 1, not before 2 s" "$(outcome "$rc" 1 $(($(now_ms) - t)) 2000 "$HANG_MS")"
[ "$(cat "$errf")" = "[lib-test] timed out after 2 s waiting for never" ] && r=ok || r="logged '$(cat "$errf")'"
check "wait_until logs the timeout" "$r"

# The same on the virtual clock (100 s per interval): tries at 0, 100, 200 and 300 s; the fourth
# is the first past 250 s, so exactly four tries and three intervals, then the timeout.
reset_sleeps; VIRTUAL_CLOCK=100
tries=0
never() { tries=$((tries + 1)); false; }
rc=0; wait_until 250 "never" never 2>/dev/null || rc=$?
[ "$rc" = 1 ] && [ "$tries" = 4 ] && [ "${slept[*]}" = "0.5 0.5 0.5" ] && r=ok ||
  r="returned $rc after $tries tries, intervals: ${slept[*]}"
check "wait_until 250 on a clock of 100 s per interval: 4 tries 0.5 s apart (the default), the last past 250 s, then 1" "$r"

reset_sleeps
rc=0; wait_until 5 "true" true || rc=$?
[ "$rc" = 0 ] && [ "${#slept[@]}" = 0 ] && r=ok || r="returned $rc after ${#slept[@]} intervals"
check "wait_until 5 true true: returns 0 at the first try, without an interval" "$r"

# A condition that becomes true at the third try. Called bare, as a script would before its
# next line: a false COMMAND must not stop it.
reset_sleeps; VIRTUAL_CLOCK=100
tries=0
third() { tries=$((tries + 1)); [ "$tries" -ge 3 ]; }
rc=0; wait_until 600 "the third try" third
[ "$rc" = 0 ] && [ "$tries" = 3 ] && [ "${#slept[@]}" = 2 ] && r=ok || r="returned $rc after $tries tries and ${#slept[@]} intervals"
check "wait_until: a condition true at the third try returns 0 there, after two intervals" "$r"

# Arguments are passed as given, never evaluated: spaces, globs and $ stay literal.
reset_sleeps
got=""
record() { got="$*|$#"; }
# shellcheck disable=SC2016  # the $(...) is meant literally
wait_until 1 "arguments" record 'a b' '*' '$(echo no)'
# shellcheck disable=SC2016
[ "$got" = 'a b * $(echo no)|3' ] && r=ok || r="got '$got'"
check "wait_until passes COMMAND's arguments as given (no eval)" "$r"

# WAIT_INTERVAL: the interval between tries, for that call only.
reset_sleeps; VIRTUAL_CLOCK=100
tries=0
fourth() { tries=$((tries + 1)); [ "$tries" -ge 4 ]; }
rc=0; WAIT_INTERVAL=0.1 wait_until 600 "the fourth try" fourth
[ "$rc" = 0 ] && [ "${slept[*]}" = "0.1 0.1 0.1" ] && r=ok || r="returned $rc, intervals: ${slept[*]}"
check "WAIT_INTERVAL=0.1: three intervals of 0.1 s before the fourth try" "$r"
[ "${WAIT_INTERVAL:-unset}" = unset ] && r=ok || r="WAIT_INTERVAL=$WAIT_INTERVAL after the call"
check "WAIT_INTERVAL=... wait_until leaves WAIT_INTERVAL unset" "$r"

# A failing function as COMMAND, the call bare: set -e does not stop the script (it would
# have exited above) and the ERR trap does not fire, for the failed tries or inside COMMAND.
reset_sleeps; VIRTUAL_CLOCK=100
fails_twice() { false; echo "set -e is off in a condition" >/dev/null; tries=$((tries + 1)); [ "$tries" -ge 3 ]; }
tries=0; trapped=0
WAIT_INTERVAL=0.1 wait_until 600 "the third try" fails_twice
[ "$tries" = 3 ] && [ "$trapped" = 0 ] && r=ok || r="$tries tries, ERR trap fired $trapped times"
check "a failing COMMAND, the call bare, trips neither set -e nor the ERR trap" "$r"

# Usage errors return 2 and say so.
reset_sleeps
rc=0; err=$(wait_until soon "x" true 2>&1) || rc=$?
[ "$rc" = 2 ] && [[ "$err" == *"whole number"* ]] && r=ok || r="returned $rc: '$err'"
check "wait_until with a bad SECONDS returns 2" "$r"
rc=0; err=$(wait_until 3 "x" 2>&1) || rc=$?
[ "$rc" = 2 ] && r=ok || r="returned $rc: '$err'"
check "wait_until without COMMAND returns 2" "$r"

# wait_gone: a process that exits at the second interval (killed there); one that never does.
reset_sleeps; VIRTUAL_CLOCK=100
command sleep 3600 &
pid=$!
ON_SLEEP_AT=2 ON_SLEEP='kill "$pid"; wait "$pid" 2>/dev/null || true'
rc=0; wait_gone 600 "a process killed at the second interval" "$pid" || rc=$?
[ "$rc" = 0 ] && [ "${#slept[@]}" = 2 ] && ! kill -0 "$pid" 2>/dev/null && r=ok ||
  r="returned $rc after ${#slept[@]} intervals"
check "wait_gone returns 0 at the first try after its process exited" "$r"
reset_sleeps
command sleep 3600 &
pid=$!
t=$(now_ms); rc=0; wait_gone 1 "sleep 3600" "$pid" 2>"$errf" || rc=$?
check "wait_gone 1 on a process that lives on returns 1, not before 1 s" "$(outcome "$rc" 1 $(($(now_ms) - t)) 1000 "$HANG_MS")"
[ "$(cat "$errf")" = "[lib-test] timed out after 1 s waiting for sleep 3600" ] && r=ok || r="logged '$(cat "$errf")'"
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
command sleep 3600 &
pid=$!
reset_sleeps; VIRTUAL_CLOCK=100
tries=0
rc=0; wait_ready 600 "the third try" "$pid" "$logf" third 2>"$errf" || rc=$?
[ "$rc" = 0 ] && [ "$tries" = 3 ] && r=ok || r="returned $rc after $tries tries"
check "wait_ready: ready at the third try while the process lives returns 0 there" "$r"
[ ! -s "$errf" ] && r=ok || r="logged '$(cat "$errf")'"
check "wait_ready logs nothing when ready" "$r"
# One of two processes exits at the second interval: wait_ready returns 1 at the next try, on
# the virtual clock 200 s into a 3000 s timeout.
command sleep 3600 &
gone=$!
reset_sleeps; VIRTUAL_CLOCK=100
ON_SLEEP_AT=2 ON_SLEEP='kill "$gone"; wait "$gone" 2>/dev/null || true'
rc=0; wait_ready 3000 "never ready" "$pid $gone" "$logf" false 2>"$errf" || rc=$?
[ "$rc" = 1 ] && [ "${#slept[@]}" = 2 ] && r=ok || r="returned $rc after ${#slept[@]} intervals"
check "wait_ready: one of two processes exits: returns 1 at the next try, not at the timeout" "$r"
err=$(cat "$errf")
[[ "$err" == "[lib-test] never ready: process $gone exited"$'\n'"[lib-test] the last lines of $logf:"$'\n'"line 11"$'\n'* ]] &&
  [[ "$err" == *$'\n'"line 50" ]] && r=ok || r="logged '$err'"
check "wait_ready names the process that exited and shows the log's last 40 lines" "$r"
reset_sleeps
t=$(now_ms); rc=0; wait_ready 1 "slow" "$pid" "" false 2>"$errf" || rc=$?
check "wait_ready 1 with a live process that never gets ready returns 1, not before 1 s" "$(outcome "$rc" 1 $(($(now_ms) - t)) 1000 "$HANG_MS")"
[ "$(cat "$errf")" = "[lib-test] timed out after 1 s waiting for slow" ] && r=ok || r="logged '$(cat "$errf")'"
check "wait_ready's timeout without a log file logs the timeout only" "$r"
rc=0; err=$(wait_ready 1 "nothing" "" "" true 2>&1) || rc=$?
[ "$rc" = 2 ] && r=ok || r="returned $rc: '$err'"
check "wait_ready without PID returns 2" "$r"
rc=0; err=$(wait_ready 1 "x" "$pid" "" 2>&1) || rc=$?
[ "$rc" = 2 ] && r=ok || r="returned $rc: '$err'"
check "wait_ready without COMMAND returns 2" "$r"
kill "$pid"; wait "$pid" 2>/dev/null || true
wait
rm -f "$logf" "$errf"
unset -f sleep

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
