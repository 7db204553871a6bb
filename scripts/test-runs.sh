#!/usr/bin/env bash
# Shows the test command keeps its promise (issue #55, docs/testing.md "Stages, budgets and
# what each proves"): runs in a row that all pass, each stage within its budget. Runs
# `bash .ci/run` (CI's command: `CI=true`, nothing skipped) N times, one after another, and
# keeps each run's log and stage times under DIR; then prints one line per run (passed or the
# stage it failed in, its minutes, the stages over budget) and exits non-zero unless every run
# passed.
#
#   bash scripts/test-runs.sh [--cold] [N]     N runs (default 5)
#
# Warm: the runs use this clone and the caches as they are (run it once before, or count the
# first run as the warm-up). --cold: the first run is from nothing, as CI's fresh machine: a
# fresh clone of HEAD under DIR with a home directory of its own, so that ~/.cache (the
# builds, the brokers' state), ~/.cargo's registry, ~/go, ~/.m2 and pip's cache are out of
# reach (the Rust toolchain and the Debian packages stay); the N runs after it are warm runs
# in that clone. Docker's images and the Kubernetes nodes' state stay where they are: move
# them aside by hand for a run from nothing in every respect.
#
# Settings (environment): SLUICE_TEST_RUNS_DIR (DIR; default
# ~/.cache/sluice/test-runs/<date>). The machine should be otherwise quiet: the figures are
# the run's, and other work beside it lengthens every stage.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
. scripts/lib.sh
LOG_TAG="test-runs"

cold=""
if [ "${1:-}" = --cold ]; then cold=1; shift; fi
runs="${1:-5}"
case "$runs" in '' | *[!0-9]*) fail "N must be a whole number, not '$runs'" ;; esac
dir="${SLUICE_TEST_RUNS_DIR:-$HOME/.cache/sluice/test-runs/$(date -u +%Y%m%d-%H%M%S)}"
mkdir -p "$dir"
clone="$PWD"
env_for_runs=()

if [ -n "$cold" ]; then
  clone="$dir/clone"
  home="$dir/home"
  log "a fresh clone of $(git rev-parse --short HEAD) in $clone, home $home"
  rm -rf "$clone" "$home"
  git clone --quiet --no-hardlinks "$PWD" "$clone"
  git -C "$clone" checkout --quiet "$(git rev-parse HEAD)"
  mkdir -p "$home"
  # The toolchain stays reachable; everything the run downloads or builds goes to the new home.
  env_for_runs=(
    "HOME=$home"
    "RUSTUP_HOME=${RUSTUP_HOME:-$HOME/.rustup}"
    "CARGO_HOME=$home/.cargo"
    "PATH=${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
  )
fi

# run NAME: one run of CI's command in the clone; its log and times under DIR.
results=()
failed=0
run() {
  local name="$1" rc=0 start=$SECONDS
  log "run $name: log $dir/$name.log"
  (cd "$clone" && env "${env_for_runs[@]}" CI=true SLUICE_TEST_TIMES="$dir/$name-times.md" \
    bash .ci/run) >"$dir/$name.log" 2>&1 || rc=$?
  local took=$(((SECONDS - start) / 60)) over
  over=$(grep -c '^warning: the stage .* over its .* budget' "$dir/$name.log" || true)
  if [ "$rc" = 0 ]; then
    results+=("$name: passed in $took min, $over stage(s) over budget")
  else
    failed=1
    results+=("$name: FAILED (exit $rc) in $took min: $(grep '^== FAILED' "$dir/$name.log" | tail -n 1)")
  fi
}

if [ -n "$cold" ]; then run cold; fi
for i in $(seq 1 "$runs"); do run "warm-$i"; done

echo "== test runs ($dir)"
printf '  %s\n' "${results[@]}"
grep -h '^warning: the stage' "$dir"/*.log 2>/dev/null | sort | uniq -c | sed 's/^/  /' || true
exit "$failed"
