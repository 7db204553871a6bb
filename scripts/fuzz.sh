#!/usr/bin/env bash
# Coverage-guided fuzzing of every decoder of outside bytes (fuzz/, its own workspace), with
# AFL++ through cargo-afl on the stable toolchain. Builds the targets instrumented (cached
# under ~/.cache/sluice, never in the clone), runs each for FUZZ_SECONDS (default 20) from
# its seed corpus in fuzz/corpus/<target>/, FUZZ_JOBS (default: one per core) at a time, and
# fails if any target found a crash or a hang (printing the input and how to reproduce it), or ran fewer than
# FUZZ_MIN_EXECS inputs (default 1000: a target that starts and executes nothing, or whose
# statistics are missing, has tested nothing, whatever it found).
#   FUZZ_SECONDS=60 scripts/fuzz.sh            all targets, a minute each
#   scripts/fuzz.sh sse bedrock                 some targets
#   scripts/fuzz.sh build                       only installs and builds (the test command
#                                               runs this in the background, early)
#   FUZZ_RESULTS=bench/results/fuzz.md FUZZ_SECONDS=100 scripts/fuzz.sh
#                                               also writes the figures there (Markdown, with
#                                               the date, commit, cores and command)
# Installs what is missing: make and a C compiler (AFL++ is built from the sources cargo-afl
# ships), cargo-afl (cargo install, into ~/.cache/sluice/cargo-bin).
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE="$HOME/.cache/sluice"
SECONDS_EACH="${FUZZ_SECONDS:-20}"
MIN_EXECS="${FUZZ_MIN_EXECS:-1000}"
TARGETS=(records sse ollama bedrock jsonl react mcp gateway config tgconfig socket shared)
BUILD_ONLY=""
if [ "${1:-}" = build ]; then BUILD_ONLY=1; shift; fi
if [ $# -gt 0 ]; then TARGETS=("$@"); fi
CARGO_AFL_VERSION=0.18.2

. scripts/prereqs.sh
prereqs make:make cc:gcc

export PATH="$CACHE/cargo-bin/bin:$PATH"
# AFL++ as cargo-afl builds it lives under XDG_DATA_HOME; keep it in the cache too.
export XDG_DATA_HOME="$CACHE/afl-data"
if ! cargo afl --version 2>/dev/null | grep -q "$CARGO_AFL_VERSION"; then
  echo "== installing cargo-afl $CARGO_AFL_VERSION"
  CARGO_TARGET_DIR="$CACHE/cargo-install-target" cargo install cargo-afl --locked \
    --version "$CARGO_AFL_VERSION" --root "$CACHE/cargo-bin"
fi
if ! compgen -G "$XDG_DATA_HOME/afl.rs/*/afl.rs-$CARGO_AFL_VERSION/afl/bin/afl-fuzz" >/dev/null; then
  echo "== building AFL++ (cargo afl config --build)"
  cargo afl config --build
fi

echo "== building the fuzz targets"
export CARGO_TARGET_DIR="$CACHE/target-fuzz-afl"
export CARGO_INCREMENTAL=0
# cargo-afl compiles every crate with `-C opt-level=3 -C codegen-units=1` (RUSTFLAGS) unless
# AFL_OPT_LEVEL says otherwise. At 1 the build from nothing took 372 s instead of 426 s
# (0.87x, 2026-11-27, each alone on this machine's 2 cores) and the fuzzers ran as many
# inputs (records and jsonl, 10 s each, twice: within the runs' noise of each other).
export AFL_OPT_LEVEL="${AFL_OPT_LEVEL:-1}"
(cd fuzz && cargo afl build --release --locked --bins)
BIN="$CARGO_TARGET_DIR/release"
[ -z "$BUILD_ONLY" ] || exit 0

# Containers: no CPU frequency governor, a core-pattern AFL cannot check, no terminal, and
# cores shared with other work (no pinning).
export AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 AFL_NO_UI=1 AFL_NO_AFFINITY=1
export AFL_SKIP_CRASHES=0 AFL_QUIET=1

OUT="$CACHE/fuzz-out"
mkdir -p "$OUT"
# FUZZ_JOBS targets at a time (default: one per core): each afl-fuzz is one process on one
# core, so on this machine's 2 cores two at a time give every target its FUZZ_SECONDS of a core
# in half the wall time (the stage took 249 s one at a time, 2026-12-07).
JOBS="${FUZZ_JOBS:-$(nproc)}"
# fuzz_one TARGET: runs it; its exit status goes to $OUT/TARGET.rc.
fuzz_one() {
  local t=$1 rc=0
  rm -rf "${OUT:?}/$t"
  # -t: an input taking longer than 1 s is a hang (quadratic blow-up); -m: 2 GiB of address
  # space, so an allocation sized by a length field is a crash, not a slow swap.
  cargo afl fuzz -V "$SECONDS_EACH" -t 1000 -m 2048 -i "fuzz/corpus/$t" -o "$OUT/$t"     -- "$BIN/$t" >"$OUT/$t.log" 2>&1 || rc=$?
  echo "$rc" >"$OUT/$t.rc"
}
for t in "${TARGETS[@]}"; do
  rm -f "$OUT/$t.rc"
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
  fuzz_one "$t" &
done
wait
failed=0
rows=()
printf '%-9s %10s %6s %8s %8s %8s %6s\n' target execs secs execs/s corpus coverage found
for t in "${TARGETS[@]}"; do
  log="$OUT/$t.log"
  if [ "$(cat "$OUT/$t.rc" 2>/dev/null)" != 0 ]; then
    echo "afl-fuzz failed for $t; its log: $log" >&2
    tail -20 "$log" >&2
    failed=1
    continue
  fi
  stats="$OUT/$t/default/fuzzer_stats"
  get() { awk -F' *: *' -v k="$1" '$1 == k { print $2 }' "$stats" 2>/dev/null; }
  execs=$(get execs_done)
  if ! [ "${execs:-0}" -ge "$MIN_EXECS" ] 2>/dev/null; then
    echo "$t executed ${execs:-nothing} inputs in ${SECONDS_EACH}s (at least $MIN_EXECS wanted):" \
      "it tested nothing worth a pass; its log: $log" >&2
    tail -20 "$log" >&2
    failed=1
  fi
  crashes=$(find "$OUT/$t/default/crashes" -name 'id:*' 2>/dev/null | wc -l)
  hangs=$(find "$OUT/$t/default/hangs" -name 'id:*' 2>/dev/null | wc -l)
  printf '%-9s %10s %6s %8s %8s %8s %6s\n' "$t" "$(get execs_done)" "$(get run_time)" \
    "$(get execs_per_sec)" "$(get corpus_count)" "$(get bitmap_cvg)" "$((crashes + hangs))"
  rows+=("| $t | $(get execs_done) | $(get run_time) s | $(get corpus_count) | $(get bitmap_cvg) | $((crashes + hangs)) |")
  for f in "$OUT/$t"/default/crashes/id:* "$OUT/$t"/default/hangs/id:*; do
    [ -e "$f" ] || continue
    failed=1
    echo "FOUND ($t): $f" >&2
    echo "  reproduce: $BIN/$t < '$f'" >&2
  done
done
if [ -n "${FUZZ_RESULTS:-}" ]; then
  commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  [ -z "$(git status --porcelain --untracked-files=no -- ":/" ":(top,exclude)bench/results" 2>/dev/null)" ] || commit="$commit with uncommitted changes"
  {
    echo "Measured $(date -u '+%Y-%m-%d %H:%M UTC') at commit $commit on this machine ($(nproc) cores," \
      "$JOBS targets at a time) by \`FUZZ_SECONDS=$SECONDS_EACH bash scripts/fuzz.sh${*:+ $*}\`."
    echo
    echo "| target | executions | time | corpus (paths) | map coverage | crashes / hangs |"
    echo "|---|---|---|---|---|---|"
    printf '%s\n' "${rows[@]}"
  } > "$FUZZ_RESULTS"
  echo "figures written to $FUZZ_RESULTS"
fi
if [ "$failed" -ne 0 ]; then
  echo "fuzzing found problems (see above); outputs in $OUT" >&2
  exit 1
fi
echo "fuzzing: no crash or hang in ${#TARGETS[@]} targets, ${SECONDS_EACH}s each, each at least $MIN_EXECS inputs"
