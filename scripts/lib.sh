# shellcheck shell=bash
# The helpers every script shares (issue #24 §8). Sourced, never run:
#   . "$(dirname "${BASH_SOURCE[0]}")/lib.sh"          (from scripts/; adjust the path elsewhere)
#   LOG_TAG=my-script
# Safe under `set -euo pipefail` (and `set -E` with an ERR trap): nothing here fails outside
# a condition, and no shell option is changed; wait_until runs its COMMAND with its arguments
# as given (no eval, output not redirected) in a condition, so a failing COMMAND trips neither
# `set -e` nor an ERR trap. A malformed SECONDS or a missing PID is logged and returns 2.
# Checked by scripts/lib-test.sh.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  echo "${BASH_SOURCE[0]} is sourced by scripts, not run" >&2
  exit 2
fi
# Sourced twice (a library that sources it, after a script that did and then replaced `fail`
# with its own): the first definitions stay.
if declare -F wait_until >/dev/null; then return 0; fi

# log MESSAGE...: prints "[$LOG_TAG] MESSAGE" on stderr (LOG_TAG unset: the script's file name).
log() { printf '[%s] %s\n' "${LOG_TAG:-${0##*/}}" "$*" >&2; }

# fail MESSAGE...: logs MESSAGE, then exits the script with status 1 (a script may redefine it after sourcing).
fail() { log "$@"; exit 1; }

# wait_until SECONDS DESCRIPTION COMMAND [ARG...]: runs COMMAND every ${WAIT_INTERVAL:-0.5} s until it returns 0 (returns 0) or more than SECONDS have passed (logs "timed out after SECONDS s waiting for DESCRIPTION", returns 1).
wait_until() {
  local secs="${1:-}" what="${2:-}" start=$SECONDS
  [ $# -ge 3 ] || { log "wait_until: usage: wait_until SECONDS DESCRIPTION COMMAND [ARG...]"; return 2; }
  case "$secs" in
    '' | *[!0-9]*) log "wait_until: SECONDS must be a whole number, not '$secs'"; return 2 ;;
  esac
  shift 2
  while :; do
    if "$@"; then return 0; fi
    if [ $((SECONDS - start)) -gt "$secs" ]; then
      log "timed out after $secs s waiting for $what"
      return 1
    fi
    sleep "${WAIT_INTERVAL:-0.5}"
  done
}

# wait_gone SECONDS DESCRIPTION PID: as wait_until, for process PID to exit (`kill -0` fails): returns 0 once it has, 1 on timeout; sends no signal.
wait_gone() {
  local secs="${1:-}" what="${2:-}" pid="${3:-}"
  [ -n "$pid" ] || { log "wait_gone: no PID given for $what"; return 2; }
  wait_until "$secs" "$what" _lib_gone "$pid"
}
# _lib_gone PID: true once PID is no process (wait_gone's condition).
_lib_gone() { ! kill -0 "$1" 2>/dev/null; }

# wait_ready SECONDS DESCRIPTION PIDS LOGFILE COMMAND [ARG...]: as wait_until, for a process
# that is starting: returns 0 once COMMAND succeeds. If a process of PIDS (one or more, space-
# separated) exits first, logs "DESCRIPTION: process PID exited", or on timeout logs as
# wait_until does; either way then logs LOGFILE's last 40 lines (when LOGFILE is a file) and
# returns 1. Sends no signal.
wait_ready() {
  local secs="${1:-}" what="${2:-}" pids="${3:-}" logfile="${4:-}"
  [ $# -ge 5 ] || { log "wait_ready: usage: wait_ready SECONDS DESCRIPTION PIDS LOGFILE COMMAND [ARG...]"; return 2; }
  [ -n "${pids// /}" ] || { log "wait_ready: no PID given for $what"; return 2; }
  shift 4
  _LIB_EXITED=""
  if wait_until "$secs" "$what" _lib_ready "$pids" "$@"; then
    [ -z "$_LIB_EXITED" ] && return 0
    log "$what: process $_LIB_EXITED exited"
  fi
  if [ -n "$logfile" ] && [ -f "$logfile" ]; then
    log "the last lines of $logfile:"
    tail -n 40 "$logfile" >&2 || true
  fi
  return 1
}
# _lib_ready PIDS COMMAND...: wait_ready's condition: true when COMMAND succeeds, or when a
# process of PIDS is gone (noted in _LIB_EXITED).
_lib_ready() {
  local pids="$1" pid
  shift
  if "$@"; then return 0; fi
  for pid in $pids; do
    if ! kill -0 "$pid" 2>/dev/null; then _LIB_EXITED=$pid; return 0; fi
  done
  return 1
}

# quietly COMMAND [ARG...]: runs COMMAND with its stdout and stderr discarded; its status.
quietly() { "$@" >/dev/null 2>&1; }

# free_port [HOST]: prints a TCP port free on HOST (default 127.0.0.1), which the kernel picked (bind to port 0).
free_port() {
  python3 -c 'import socket, sys; s = socket.socket(); s.bind((sys.argv[1], 0)); print(s.getsockname()[1])' \
    "${1:-127.0.0.1}"
}

# fake_openai_bin: prints the path of fake-openai, the fake OpenAI-compatible server scripted
# by the prompt (sluice-tests' src/bin/fake-openai.rs): $SLUICE_FAKE_OPENAI, else the tests'
# build's in $CARGO_TARGET_DIR (default ~/.cache/sluice/target), built when missing as the
# test command builds it (`cargo test --workspace --no-run --lib --bins --test '*'`: selecting a
# package would unify features differently and rebuild dependencies). Returns 1 if it cannot
# be had.
fake_openai_bin() {
  local target="${CARGO_TARGET_DIR:-$HOME/.cache/sluice/target}"
  local bin="${SLUICE_FAKE_OPENAI:-$target/debug/fake-openai}"
  if [ ! -x "$bin" ] && [ -z "${SLUICE_FAKE_OPENAI:-}" ]; then
    log "building fake-openai (the tests' build)"
    (cd "$(dirname "${BASH_SOURCE[0]}")/.." &&
      CARGO_TARGET_DIR="$target" cargo test --workspace --locked --no-run --lib --bins --test '*' -q) >&2 || return 1
  fi
  [ -x "$bin" ] || { log "no fake-openai binary at $bin"; return 1; }
  printf '%s\n' "$bin"
}
