#!/usr/bin/env bash
# Runs every check and test of sluice, starting what they need: a real Apache Pulsar
# standalone broker (deploy/pulsar/pulsar.sh; a second one is started by the broker-restart
# test itself), and a secured multi-broker cluster (deploy/pulsar/cluster.sh: ZooKeeper, 3
# bookies, 2 brokers, TLS, tokens, authorization) for the production-Pulsar suite. Works on a fresh machine of this kind: installs protoc and Maven when
# missing; heavy downloads and builds are cached outside the clone, under ~/.cache/sluice
# and ~/.m2. The deployment checks (scripts/check-deploy.sh) build their tools from the Go
# module proxy and PyPI once, under ~/.cache/sluice/deploy. At the end, the compose stack
# runs in Docker (scripts/test-stack.sh: dockerd started when none runs, images made from
# Debian's packages), the Kubernetes manifests are applied to a real API server
# (scripts/test-k8s.sh: kube-apiserver built from the Go module proxy, Debian's etcd), and
# run on a two-node Kubernetes (scripts/test-k8s-run.sh, deploy/k8s-local/cluster.sh).
#
# Usage: bash scripts/test.sh [STAGE...]   (default: all, which is what CI runs)
#   unit     the tests that need no broker and no network: every crate's unit tests and the
#            documentation's checks: plain `cargo test` (~5 s of tests once built), as the
#            integration suites are `test = false` in their manifests
#   checks   the deployment files, formatting, clippy, fuzzing
#   broker   both Pulsar brokers and the local LLM, then every test (--lib --bins --test '*')
#   docs     the book (mdBook)
#   interop  TrustGraph's own processes beside sluice's (starts the broker)
#   stack    the compose stack in Docker
#   k8s      the Kubernetes manifests on a real API server, then on two nodes
#   all      all of the above but `unit` (the broker stage runs those tests too)
set -euo pipefail
cd "$(dirname "$0")/.."

STAGES=" ${*:-all} "
for s in $STAGES; do
  case "$s" in
    unit | checks | broker | docs | interop | stack | k8s | all) ;;
    *) echo "unknown stage: $s (unit, checks, broker, docs, interop, stack, k8s or all)" >&2; exit 2 ;;
  esac
done
# want STAGE: whether this run includes STAGE (`all` includes every stage but unit).
want() {
  [[ "$STAGES" == *" $1 "* ]] || { [ "$1" != unit ] && [[ "$STAGES" == *" all "* ]]; }
}

# The run builds and runs from one fixed path, a checkout of this clone's commit under the
# cache (SLUICE_SRC, ~/.cache/sluice/src): cargo keys a workspace crate's build by its path
# and judges it fresh by its files' times, so a fresh clone (a new path, every file just
# written) rebuilt every sluice crate, ~6.5 min of the warm run's 35 (2026-12-07), and left
# that build's ~4 GB behind in the target directory at every run. `git checkout` in the fixed
# checkout rewrites only the files whose content changed, so cargo rebuilds what a change
# touched. What the run writes into the tree (bench/results) is copied back to this clone at
# the end. Not for a clone with uncommitted changes (they are not in its commit), nor when
# another run is using the checkout: then the run stays here. SLUICE_SRC=off: always here.
if [ -z "${SLUICE_ORIGIN:-}" ] && [ "${SLUICE_SRC:-}" != off ]; then
  src="${SLUICE_SRC:-${SLUICE_CACHE:-$HOME/.cache/sluice}/src}"
  if [ -n "$(git status --porcelain 2>/dev/null)" ] || ! git rev-parse -q --verify HEAD >/dev/null 2>&1; then
    echo "note: this clone has uncommitted changes (or is not a git clone): the run builds here, not from $src" >&2
  else
    mkdir -p "$(dirname "$src")"
    # The checkout is a run's while its process lives ($src.pid: the exec below keeps the
    # pid). A lock held for the run itself would be inherited by what outlives it (a
    # developer's brokers stay up), so the lock guards only this check.
    exec 9>"$src.lock"
    flock 9
    holder=$(cat "$src.pid" 2>/dev/null || true)
    if [ -n "$holder" ] && [ "$holder" != $$ ] && kill -0 "$holder" 2>/dev/null &&
      tr '\0' ' ' <"/proc/$holder/cmdline" 2>/dev/null | grep -q 'scripts/test\.sh'; then
      echo "note: another run (pid $holder) uses $src: this one builds here" >&2
      exec 9>&-
    else
      echo $$ >"$src.pid"
      exec 9>&-
      [ -d "$src/.git" ] || git init -q "$src"
      git -C "$src" fetch -q --no-tags "$PWD" HEAD
      git -C "$src" checkout -q --force --detach FETCH_HEAD
      # As a fresh clone: what an earlier run left in the tree (untracked or ignored) goes.
      git -C "$src" clean -q -ffdx
      echo "== running from $src (this clone's commit $(git rev-parse --short HEAD); results copied back here)"
      SLUICE_ORIGIN="$PWD" exec bash "$src/scripts/test.sh" "$@"
    fi
  fi
fi
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/sluice/target}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
# CI builds a fresh clone once: incremental compilation state (many GB per clone path) would
# only fill the disk, and a full disk turns the broker's bookie read-only.
if [ "${CI:-}" = "true" ]; then export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"; fi
free_gb=$(df -Pk "$HOME" | awk 'NR == 2 { print int($4 / 1048576) }')
if [ "${free_gb:-0}" -lt 15 ]; then
  echo "warning: ${free_gb} GB free under $HOME; a build of the tests takes ~15 GB, and Pulsar's bookie turns read-only above 95% disk use" >&2
fi

# Each stage's budget in seconds, from nothing (cold) and with every cache filled (warm): the
# table of docs/testing.md, which says what each stage proves. A new test or check fits in its
# stage's budget, or that table changes with it (and the whole run stays under CI's 90 min).
# The run is cold when the tests' build has no `sluice` binary yet ($CARGO_TARGET_DIR), else
# warm; SLUICE_TEST_BUDGET=cold|warm says otherwise. Over budget is a warning, not a failure.
declare -A BUDGET_COLD=(
  [set-up]=120 [unit]=600 [deploy]=120 [lint]=300 [brokers]=60 [build]=480 [llm]=60
  [tests]=660 [fuzz]=240 [interop]=120 [stack]=180 [k8s-api]=120 [k8s-run]=210 [docs]=30
)
declare -A BUDGET_WARM=(
  [set-up]=20 [unit]=60 [deploy]=40 [lint]=90 [brokers]=30 [build]=60 [llm]=10
  [tests]=660 [fuzz]=120 [interop]=90 [stack]=120 [k8s-api]=60 [k8s-run]=180 [docs]=20
)
# Each stage's wall time, printed at the end against its budget and, when SLUICE_TEST_TIMES
# names a file, written there as Markdown with the date, commit and cores (the figures of
# docs/testing.md). The time before the first stage (prerequisites installed, background jobs
# started) is the `set-up` row.
STAGE_KEY="set-up" STAGE_NAME="set-up (prerequisites; background builds and brokers started)"
STAGE_START=$SECONDS
STAGE_ROWS=() BUDGET_WARNINGS=()
# stage KEY DESCRIPTION: ends the stage running (its row: description, seconds, budget) and
# starts the next; `stage ""` ends the last.
stage() {
  local took=$((SECONDS - STAGE_START)) budget
  if [ -n "$STAGE_NAME" ]; then
    budget=${BUDGETS[$STAGE_KEY]:-}
    STAGE_ROWS+=("| $STAGE_NAME | $took | ${budget:-none} |")
    if [ -n "$budget" ] && [ "$took" -gt "$budget" ]; then
      BUDGET_WARNINGS+=("warning: the stage \"$STAGE_NAME\" took $took s, over its $BUDGET_KIND budget of $budget s (docs/testing.md)")
    fi
  fi
  STAGE_KEY="$1" STAGE_NAME="${2:-}" STAGE_START=$SECONDS
  [ -z "$STAGE_NAME" ] || echo "== $STAGE_NAME"
}
BUDGET_KIND="${SLUICE_TEST_BUDGET:-}"
if [ -z "$BUDGET_KIND" ]; then
  if [ -x "$CARGO_TARGET_DIR/debug/sluice" ]; then BUDGET_KIND=warm; else BUDGET_KIND=cold; fi
fi
case "$BUDGET_KIND" in
  cold) declare -n BUDGETS=BUDGET_COLD ;;
  warm) declare -n BUDGETS=BUDGET_WARM ;;
  *) echo "SLUICE_TEST_BUDGET is cold or warm, not $BUDGET_KIND" >&2; exit 2 ;;
esac

# Checks that could not run here (a tool from PyPI missing outside CI) write one line each
# to this file (sluice_tests::outside_tool, scripts/test-stack.sh); the summary counts them.
# Under CI nothing may be skipped.
SLUICE_SKIP_LOG=$(mktemp)
export SLUICE_SKIP_LOG

. scripts/lib.sh
. scripts/prereqs.sh
# protoc: pulsar-rs generates its protocol code at build time; maven fetches Pulsar;
# cmake, ninja and unzip build llama-server, the local LLM.
# make and a C compiler build AFL++ for the fuzzing (scripts/fuzz.sh): installed here, before
# the background jobs below, so that no two of them run apt at once.
# Chromium (Debian's) is the real browser of the security suite's browser test.
prereqs protoc:protobuf-compiler curl:curl mvn:maven cmake:cmake ninja:ninja-build unzip:unzip \
  make:make cc:gcc chromium:chromium

# The builds the later stages need run from here in the background, at low priority, in the
# time the stages below leave idle (the tests mostly wait on brokers and processes); each stage
# that needs one waits for it. Ranked by when they are needed: llama-server's first (the local
# LLM starts after the tests' build), the fuzzing's next (after the tests), the Kubernetes Go
# builds and mdBook last (the last stages). From nothing, at one equal share each, the local
# LLM stage waited ~7 min for the rest of llama-server's build (2026-11-27).
k8s_build_pid="" docs_install_pid="" prefetch_pid="" fuzz_build_pid="" llm_build_pid=""
brokers_pid=""
# low_priority PID [NICE]: background job PID's session at nice NICE (19, the lowest, by
# default; a lower value ranks it above the others). With the kernel's
# autogroups (/proc/sys/kernel/sched_autogroup_enabled, 1 on these machines) the CPU is shared
# between sessions first and nice counts only inside one: each job below is a session of its
# own (`setsid`), so `nice -n 19` alone left it an equal share beside the run (from nothing,
# 2026-11-27: clippy's build of the dependencies got about a fifth of the CPU beside four
# background builds). The session's own nice value (/proc/PID/autogroup) is what ranks it;
# without autogroups the file is absent and nice does the job alone. Written only once the job
# leads a session of its own: before its setsid() it still shares this run's, which the value
# would rank instead.
# The session appears as soon as the job's setsid runs: waited for, 60 s is a hang guard (a
# second, the limit before, could pass on a busy machine, leaving the job at normal priority).
low_priority() {
  WAIT_INTERVAL=0.02 wait_until 60 "background job $1 in a session of its own" \
    own_session_or_gone "$1" || return 0
  { echo "${2:-19}" >"/proc/$1/autogroup"; } 2>/dev/null || true
}
# own_session_or_gone PID: whether PID leads its own session (its session id, the 4th field of
# /proc/PID/stat after the command name, is its pid), or is gone.
own_session_or_gone() {
  [ ! -e "/proc/$1" ] || [ "$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | awk '{print $4}')" = "$1" ]
}
k8s_build_log="${SLUICE_CACHE:-$HOME/.cache/sluice}/k8s-build.log"
mkdir -p "$(dirname "$k8s_build_log")"
if want k8s; then
  setsid -w nice -n 19 deploy/k8s-local/cluster.sh build >"$k8s_build_log" 2>&1 &
  k8s_build_pid=$!
  low_priority "$k8s_build_pid"
fi
# mdBook (cargo install, ~3 min of CPU once) for the documentation stage, the same way.
docs_install_log="${SLUICE_CACHE:-$HOME/.cache/sluice}/docs-install.log"
if want docs; then
  setsid -w nice -n 19 bash scripts/docs.sh install >"$docs_install_log" 2>&1 &
  docs_install_pid=$!
  low_priority "$docs_install_pid"
fi
# The fuzzing's build (cargo-afl, AFL++ and the instrumented fuzz workspace: ~15 min of both
# cores from nothing, seconds when cached) and llama-server's (~7 min), the same way: on a
# fresh machine they ran in front of the tests and took the run past CI's 90 minutes
# (2026-11-27). The stages that need them wait for them.
fuzz_build_log="${SLUICE_CACHE:-$HOME/.cache/sluice}/fuzz-build.log"
if want checks; then
  setsid -w nice -n 15 bash scripts/fuzz.sh build >"$fuzz_build_log" 2>&1 &
  fuzz_build_pid=$!
  low_priority "$fuzz_build_pid" 15
fi
llm_build_log="${SLUICE_CACHE:-$HOME/.cache/sluice}/llm-build.log"
if want broker; then
  setsid -w nice -n 10 deploy/local-llm/llama-server.sh build >"$llm_build_log" 2>&1 &
  llm_build_pid=$!
  low_priority "$llm_build_pid" 10
fi
# The background builds above run under `setsid`, each in a process group of its own whose id
# is its pid: wait_job raises the priority of all of it, and stop_background ends all of it.
# The background jobs above and below, stopped when this script ends early.
stop_background() {
  local pid
  for pid in "$k8s_build_pid" "$docs_install_pid" "$fuzz_build_pid" "$llm_build_pid"; do
    [ -z "$pid" ] || kill -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true
  done
  [ -z "$prefetch_pid" ] || kill "$prefetch_pid" 2>/dev/null || true
  [ -z "$brokers_pid" ] || kill -- "-$brokers_pid" 2>/dev/null || kill "$brokers_pid" 2>/dev/null || true
}
# results_back: in a run from the fixed checkout (above), the files it wrote under
# bench/results, copied back to the clone it was started from.
results_back() {
  [ -n "${SLUICE_ORIGIN:-}" ] || return 0
  local f
  while IFS= read -r -d '' f; do
    mkdir -p "$SLUICE_ORIGIN/$(dirname "$f")"
    cp "$f" "$SLUICE_ORIGIN/$f"
  done < <(git ls-files -z --modified --others --exclude-standard -- bench/results)
}
# on_exit CLEANUP: runs CLEANUP; when the run failed, says last which stage it failed in (CI
# shows a run's last lines, and a stage's own message may be followed by its services' logs).
on_exit() {
  local rc=$?
  "$1"
  results_back
  [ "$rc" -eq 0 ] || echo "== FAILED (exit $rc) in the stage: ${STAGE_NAME:-setting up}; its message is above" >&2
}
trap 'on_exit stop_background' EXIT
# wait_job PID LOG WHAT: waits for a background job; if it failed, shows its log's tail and
# ends the run. The run has nothing else to do meanwhile, so the job (its process group, the
# compilers it starts included; its session, see low_priority) goes on at normal priority: at
# nice 19 it shared the CPU with
# the other background builds while the run waited (from nothing, llama-server's build held
# the local-LLM stage for many minutes that way, 2026-11-27). Without the right to raise a
# priority (not root), it goes on as it was.
wait_job() {
  renice -n 0 -g "$1" >/dev/null 2>&1 || true
  { echo 0 >"/proc/$1/autogroup"; } 2>/dev/null || true
  wait "$1" && return 0
  echo "$3 failed; its log:" >&2
  tail -n 40 "$2" >&2
  exit 1
}

# stop_brokers: what the run started for its tests, stopped when it ends (the brokers only
# under CI: a developer's stay up for the next run of a suite).
stop_brokers() {
  stop_background
  [ -z "${cluster_tests_pid:-}" ] || kill "$cluster_tests_pid" 2>/dev/null || true
  # The broker-restart test starts its own broker on 6652; never leave it behind.
  PULSAR_PORT=6652 PULSAR_HTTP_PORT=8082 PULSAR_BK_PORT=3183 deploy/pulsar/pulsar.sh stop || true
  # Only a local LLM this run started (the interop stage alone starts none).
  [ -z "${started_llm:-}" ] || deploy/local-llm/llama-server.sh stop || true
  if [ "${CI:-}" = "true" ]; then
    deploy/pulsar/pulsar.sh stop || true
    deploy/pulsar/cluster.sh stop || true
  fi
}

# The Pulsar brokers start from here in the background while the checks compile (the broker
# stage waits for them): Pulsar's distribution first (Maven Central, once; cached), then the
# standalone broker (~10 s) for the broker and interop stages, then the secured cluster (six
# JVMs, ~1-2 min) for the production-Pulsar suite (services/cli/tests/cluster.rs, which under
# CI fails without it). Both start from empty data at every run: CI once failed because the
# cluster's data, left by a run the machine's restart cut short, held a ledger that did not
# recover ("Error while recovering ledger error code: -10").
brokers_log="${SLUICE_CACHE:-$HOME/.cache/sluice}/brokers-start.log"
# Downloads that wait on the network rather than the CPU (the Python venvs from PyPI), fetched
# on a fresh machine while the first stages compile; the stages that use them wait for this
# first, and call the same idempotent scripts again, which report any failure. Seconds when
# cached.
prefetch_log="${SLUICE_CACHE:-$HOME/.cache/sluice}/prefetch.log"
if want broker || want interop; then
  trap 'on_exit stop_brokers' EXIT
  # A session and process group of its own, like the background builds: a run that ends
  # early stops the start-ups with it (stop_background).
  start_cluster=""
  if want broker; then start_cluster=1; fi
  setsid -w bash -c 'set -e
    deploy/pulsar/pulsar.sh dist >/dev/null
    deploy/pulsar/pulsar.sh start-fresh
    if [ -n "$1" ]; then deploy/pulsar/cluster.sh start-fresh; fi' _ "$start_cluster" \
    >"$brokers_log" 2>&1 &
  brokers_pid=$!
  (
    bash scripts/tg-flow-venv.sh
    bash scripts/openai-venv.sh
    bash scripts/ollama-venv.sh
    bash scripts/anthropic-venv.sh
  ) >"$prefetch_log" 2>&1 &
  prefetch_pid=$!
fi

if want unit; then
  # No broker: the URLs name a closed port, so a test that reached for one would fail.
  stage unit "unit tests and documentation checks (no broker, no network)"
  # Plain `cargo test`: the integration suites are `test = false` in their manifests.
  PULSAR_URL=pulsar://127.0.0.1:1 PULSAR_ADMIN_URL=http://127.0.0.1:1 \
    cargo test --workspace --locked
fi

if want checks; then
stage deploy "deployment files (kustomize + kubeconform, docker compose config; offline) and the scripts' library"
bash scripts/check-deploy.sh
bash scripts/lib-test.sh

stage lint "formatting and lints"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
# The integration suites too: `test = false` leaves them out of --all-targets, and --all-targets
# with --test '*' selects only the former's targets (cargo 1.95).
cargo clippy --workspace --test '*' --locked -- -D warnings
# The code's shape (docs/architecture.md#one-way-to-read-a-response-stream): no response stream
# read by hand, no production file over 900 lines, no unexplained function over 120 lines, no
# public Result<_, String> in a library crate. A second of perl.
bash scripts/shape.sh --strict >/dev/null
# The fuzz workspace has a lock file of its own, which a dependency added to a crate it fuzzes
# leaves behind: checked here in a second, not after the fuzzing's 15 min build in the
# background (where a stale one once failed the stage: `cargo afl build --locked`).
(cd fuzz && cargo metadata --locked --format-version 1 >/dev/null) ||
  { echo "fuzz/Cargo.lock is out of date: run (cd fuzz && cargo update -w) and commit it" >&2; exit 1; }
fi


if want broker || want interop; then
stage brokers "Pulsar brokers (started at set-up: the standalone broker, then the secured cluster)"
wait "$prefetch_pid" || echo "prefetching downloads failed (its log: $prefetch_log); the stages below fetch again" >&2
if ! wait "$brokers_pid"; then
  echo "the Pulsar brokers did not start; the log:" >&2
  tail -n 60 "$brokers_log" >&2
  exit 1
fi
brokers_pid=""
cat "$brokers_log"
export PULSAR_URL=pulsar://127.0.0.1:6650 PULSAR_ADMIN_URL=http://127.0.0.1:8080
fi

if want broker; then

# TrustGraph's own CLI (PyPI trustgraph-cli, in a venv): the gateway test runs the real
# tg-list-models against sluice's gateway when it is there.
if tg_list_models=$(bash scripts/tg-cli-venv.sh); then
  export TG_LIST_MODELS="$tg_list_models"
elif [ "${CI:-}" = "true" ]; then
  echo "trustgraph-cli could not be installed from PyPI; CI needs the real tg-list-models" >&2
  exit 1
else
  echo "trustgraph-cli could not be installed; the gateway test skips the real tg-list-models" >&2
fi

# Debian's Chromium (installed above): the security suite loads a page of another origin in it
# (services/cli/tests/security.rs); never a browser build downloaded by a test tool.
if command -v chromium >/dev/null 2>&1; then
  export SLUICE_CHROMIUM="$(command -v chromium)"
fi

# OpenAI's own Python SDK (PyPI openai, in a venv): the OpenAI-dialect tests (Chat Completions
# and the Responses API) drive the gateway and `sluice serve` with it when it is there.
if openai_py=$(bash scripts/openai-venv.sh); then
  export OPENAI_PY="$openai_py"
elif [ "${CI:-}" = "true" ]; then
  echo "the openai package could not be installed from PyPI; CI needs the real OpenAI SDK" >&2
  exit 1
else
  echo "the openai package could not be installed; the OpenAI SDK tests are skipped" >&2
fi

# Ollama's own Python client (PyPI ollama, in a venv): the Ollama API tests drive the gateway
# with it when it is there.
if ollama_py=$(bash scripts/ollama-venv.sh); then
  export OLLAMA_PY="$ollama_py"
elif [ "${CI:-}" = "true" ]; then
  echo "the ollama package could not be installed from PyPI; CI needs the real Ollama client" >&2
  exit 1
else
  echo "the ollama package could not be installed; the Ollama client tests are skipped" >&2
fi

# Anthropic's official Python SDK (PyPI anthropic, in a venv): the Messages API tests drive
# the gateway with it when it is there.
if anthropic_py=$(bash scripts/anthropic-venv.sh); then
  export ANTHROPIC_PY="$anthropic_py"
elif [ "${CI:-}" = "true" ]; then
  echo "the anthropic package could not be installed from PyPI; CI needs the real Anthropic SDK" >&2
  exit 1
else
  echo "the anthropic package could not be installed; the Anthropic SDK tests are skipped" >&2
fi

# TrustGraph's own Python packages (PyPI trustgraph-flow and -base, in a venv): the pacing
# test (services/cli/tests/trustgraph_pacing.rs) drives a processor with TrustGraph's own
# request/response client, and scripts/test-trustgraph.sh runs TrustGraph's processes.
if tg_flow_venv=$(bash scripts/tg-flow-venv.sh); then
  export TG_FLOW_VENV="$tg_flow_venv"
elif [ "${CI:-}" = "true" ]; then
  echo "trustgraph-flow could not be installed from PyPI; CI needs TrustGraph's own client" >&2
  exit 1
else
  echo "trustgraph-flow could not be installed; the pacing test is skipped" >&2
fi

stage build "the tests' build"
# Every test target: the unit tests (--lib --bins) and the integration suites, which are
# `test = false` in their manifests so that plain `cargo test` is the fast tier (--test '*';
# with --tests instead of --lib --bins, cargo 1.95 selects only --tests' targets).
cargo test --workspace --locked --no-run --lib --bins --test '*'
eval "$(deploy/pulsar/cluster.sh env)"
# The fault tables of the cluster suite (docs/production-pulsar.md).
export SLUICE_CLUSTER_RESULTS="$PWD/bench/results"

# Its build ran in the background since the start (above); the tests need it from here.
stage llm "local LLM (llama-server + SmolLM2-135M; built once, cached)"
wait_job "$llm_build_pid" "$llm_build_log" "building llama-server"
export SLUICE_LLM_API_KEY="${SLUICE_LLM_API_KEY:-sluice-test-$RANDOM$RANDOM}"
deploy/local-llm/llama-server.sh stop || true   # restart so it takes this run's key
started_llm=1
deploy/local-llm/llama-server.sh start
export SLUICE_LLM_URL=http://127.0.0.1:8766

# The production-Pulsar suite (services/cli/tests/cluster.rs, ~9 min, mostly waiting on the
# cluster's brokers and bookies through its faults) runs beside the others (~11 min; their
# brokers and ports are their own): its test binary directly, as cargo would (in its
# package's directory), in the background, and the workspace run skips its tests by their
# exact names. The soak (services/cli/tests/soak.rs: ~3 min on a broker of its own) and the
# pacing test (services/cli/tests/trustgraph_pacing.rs, ~15 s) run alone after both: the soak
# and the cluster suite restart JVMs and kill processes under load, and side by side on two
# cores a graceful broker restart took 89 s and both failed (CI, 2026-11-25); the pacing test
# sizes its load to what its Python consumer takes, measured first, and a JVM's restart
# beside it would change that in the middle. One `cargo test --workspace` for the rest, as in
# the build above: selecting packages would unify features differently and rebuild
# dependencies.
stage tests "tests (the production-Pulsar suite beside the others, then the pacing test and the soak)"
test_binaries=$(cargo test --workspace --locked --no-run --lib --bins --test '*' --message-format=json |
  python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if (m.get("reason") == "compiler-artifact" and m.get("executable")
            and m["target"]["name"] in ("cluster", "soak", "trustgraph_pacing")
            and "/services/cli" in m["manifest_path"]):
        print(m["target"]["name"], m["executable"])')
cluster_tests=$(echo "$test_binaries" | sed -n 's/^cluster //p')
soak_tests=$(echo "$test_binaries" | sed -n 's/^soak //p')
pacing_tests=$(echo "$test_binaries" | sed -n 's/^trustgraph_pacing //p')
for t in "$cluster_tests" "$soak_tests" "$pacing_tests"; do
  [ -n "$t" ] && [ -x "$t" ] || { echo "no test binary for services/cli/tests/{cluster,soak,trustgraph_pacing}.rs: $test_binaries" >&2; exit 1; }
done
skip_apart=()
for t in "$cluster_tests" "$soak_tests" "$pacing_tests"; do
  while read -r name; do skip_apart+=(--skip "$name"); done < <("$t" --list --format terse | sed -n 's/: test$//p')
done
[ "${#skip_apart[@]}" -ge 6 ] || { echo "services/cli/tests/{cluster,soak,trustgraph_pacing}.rs list too few tests: ${skip_apart[*]}" >&2; exit 1; }
cluster_tests_log="${SLUICE_CACHE:-$HOME/.cache/sluice}/cluster-tests.log"
# The processes' logs, metrics and the broker's topic stats of each fault series, kept
# outside the clone so that a failure in CI leaves the evidence to read on this machine.
export SLUICE_CLUSTER_LOGS="${SLUICE_CACHE:-$HOME/.cache/sluice}/cluster-logs"
rm -rf "$SLUICE_CLUSTER_LOGS" && mkdir -p "$SLUICE_CLUSTER_LOGS"
(cd services/cli && exec "$cluster_tests") >"$cluster_tests_log" 2>&1 &
cluster_tests_pid=$!
tests_failed=0
cargo test --workspace --locked --no-fail-fast --lib --bins --test '*' -- --exact "${skip_apart[@]}" || tests_failed=1
echo "== services/cli/tests/cluster.rs (ran beside the above; log: $cluster_tests_log, the processes' logs: $SLUICE_CLUSTER_LOGS)"
wait "$cluster_tests_pid" || tests_failed=1
cat "$cluster_tests_log"
echo "== services/cli/tests/trustgraph_pacing.rs (alone)"
(cd services/cli && exec "$pacing_tests") || tests_failed=1
echo "== services/cli/tests/soak.rs (alone)"
(cd services/cli && exec "$soak_tests") || tests_failed=1
[ "$tests_failed" = 0 ] || { echo "tests failed (above)" >&2; exit 1; }
fi

# After the tests, whose load would take the fuzzers' CPU; built in the background (above).
if want checks; then
stage fuzz "fuzzing (AFL++ through cargo-afl, ${FUZZ_SECONDS:-20} s per target; fuzz/ is its own workspace)"
wait_job "$fuzz_build_pid" "$fuzz_build_log" "building the fuzz targets"
bash scripts/fuzz.sh
fi

# The other stages run the `sluice` binary of the tests' build; without the broker stage,
# the same build (cargo test --no-run: the same features, so nothing is built twice).
if ! want broker && { want interop || want stack || want k8s; }; then
  stage build "the tests' build (for the sluice binary)"
  # The broker stage's build exactly (same targets, same features): `target/debug/sluice` is
  # built for the integration suites (`--test '*'`, which run it as a process), not for the
  # unit tests, so a plain `cargo test --no-run` left an earlier build's binary in place (the
  # stack and Kubernetes stages run alone then ran a stale sluice) or none at all.
  cargo test --workspace --locked --no-run --lib --bins --test '*'
fi

# TrustGraph's own processes (PyPI trustgraph-flow, unmodified, in a venv) beside sluice's
# --config-service processors, on the broker above (issue #14).
if want interop; then
stage interop "TrustGraph's processes with sluice's"
SLUICE_BIN="$CARGO_TARGET_DIR/debug/sluice" bash scripts/test-trustgraph.sh
fi

# The image built with the real Dockerfile (on bases made from Debian's packages: no image
# registry here), the compose stack up with Prometheus, answers through the gateway
# container, every dashboard panel's data, three replicas and a kill (issue #12).
if want stack; then
stage stack "the compose stack (docker)"
# sluice's image: the Dockerfile's runtime stage with the tests' own build of the binary
# (scripts/stack-images.sh): a release build in Docker's builder would add ~15 min of both
# cores to a fresh machine's run, past CI's limit. `docker build -f deploy/docker/Dockerfile .`
# builds the shipped image (docs/deploying.md).
export SLUICE_IMAGE_BINARY="$CARGO_TARGET_DIR/debug/sluice"
# Its figures as a results file (docs/deploying.md quotes them from there).
SLUICE_STACK_FIGURES="${SLUICE_STACK_FIGURES:-$PWD/bench/results/stack.md}" bash scripts/test-stack.sh
fi

# The manifests applied to a real kube-apiserver (built from the Go module proxy) on Debian's
# etcd, with Pod Security enforcing `restricted` and broken manifests refused (issue #12).
if want k8s; then
stage k8s-api "Kubernetes: the manifests on a real API server"
wait_job "$k8s_build_pid" "$k8s_build_log" "building the Kubernetes binaries"
bash scripts/test-k8s.sh

# deploy/k8s running on a two-node Kubernetes made of upstream parts (issue #22): pods
# Ready through their probes, Pod Security on the running containers, sluice invoke through
# the gateway's Service, rolling updates, a pod deleted mid-stream and a node drained under
# 64 streams, KEDA scaling text-completion on a backlog.
stage k8s-run "Kubernetes: deploy/k8s running on two nodes"
SLUICE_K8S_FIGURES="${SLUICE_K8S_FIGURES:-$PWD/bench/results/k8s.md}" \
  SLUICE_BIN="$CARGO_TARGET_DIR/debug/sluice" bash scripts/test-k8s-run.sh
fi

# The book of docs/ built with mdBook, warnings failing it (its links and chapters were
# checked by tests/tests/docs.rs, in the broker and unit stages). Last: a failed install of
# mdBook (crates.io) must not keep the stages above from running.
if want docs; then
stage docs "documentation (mdBook)"
wait_job "$docs_install_pid" "$docs_install_log" "installing mdBook"
bash scripts/docs.sh
fi

stage ""
skipped=$(grep -c . "$SLUICE_SKIP_LOG" || true)
times=$(
  commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  [ -z "$(git status --porcelain --untracked-files=no -- ":/" ":(top,exclude)bench/results" 2>/dev/null)" ] || commit="$commit with uncommitted changes"
  echo "Measured $(date -u '+%Y-%m-%d %H:%M UTC') at commit $commit on this machine ($(nproc) cores), CI=${CI:-}, by \`bash scripts/test.sh${*:+ $*}\`: $((SECONDS / 60)) min $((SECONDS % 60)) s in all."
  echo
  echo "| stage | seconds | $BUDGET_KIND budget (s) |"
  echo "|---|---|---|"
  printf '%s\n' "${STAGE_ROWS[@]}"
)
echo "$times"
# Over budget: a warning, not a failure (docs/testing.md says what to do about it).
if [ "${#BUDGET_WARNINGS[@]}" -gt 0 ]; then printf '%s\n' "${BUDGET_WARNINGS[@]}"; fi
if [ -n "${SLUICE_TEST_TIMES:-}" ]; then echo "$times" >"$SLUICE_TEST_TIMES"; fi
echo "== summary: every stage passed ($(echo $STAGES)) in $((SECONDS / 60)) min, ${skipped} check(s) skipped"
sed 's/^/  skipped: /' "$SLUICE_SKIP_LOG"
if [ "${CI:-}" = "true" ] && [ "$skipped" -gt 0 ]; then
  echo "CI runs every check: ${skipped} skipped" >&2
  exit 1
fi
