#!/usr/bin/env bash
# Builds TensorZero's gateway (tag 2026.4.0, its published source, unmodified) for the
# overhead scenario (`bash bench/run.sh overhead` uses it when it is there). Not part of the
# test command. Prints the binary's path.
#
# Why 2026.4.0: from 2026.4.1 on, the gateway depends on deno_core's v8, whose build script
# downloads a prebuilt V8 library from GitHub's release assets, which these machines cannot
# reach. The source pins Rust 1.93.0 (rustup installs it). sqlx's query macros read the
# checked-in query data (SQLX_OFFLINE), so no database is needed to build; none is needed to
# run either, with observability off. Two dependencies come from git (hyperium/mime,
# tensorzero/durable): where GitHub is out of reach, set TZ_GIT_MIRRORS to a directory holding
# bare mirrors named hyperium+mime/repo and tensorzero+durable/repo.
#
# Settings: TZ_SRC (default ~/.cache/sluice/tensorzero-src), TZ_TARGET_DIR (its cargo target
# directory, default ~/.cache/sluice/tensorzero-target). Measured here: 502 crates, about 40 min at nice 19 on
# 2 busy cores.
set -euo pipefail
tag=2026.4.0
commit=e1b8b7446e1291f7ba4070fcda048c89bef9c7a1
src="${TZ_SRC:-$HOME/.cache/sluice/tensorzero-src}"
export CARGO_TARGET_DIR="${TZ_TARGET_DIR:-$HOME/.cache/sluice/tensorzero-target}"
export CARGO_INCREMENTAL=0 SQLX_OFFLINE=true
if [ ! -d "$src/.git" ]; then
  git clone -q --branch "$tag" https://github.com/tensorzero/tensorzero "$src" >&2
fi
[ "$(git -C "$src" rev-parse HEAD)" = "$commit" ] || git -C "$src" checkout -q "$commit"
[ "$(git -C "$src" rev-parse HEAD)" = "$commit" ] || { echo "tensorzero.sh: $src is not at $commit" >&2; exit 1; }
cd "$src/crates"
rustup toolchain list | grep -q '^1\.93\.0' || rustup toolchain install 1.93.0 --profile minimal >&2
export RUSTUP_TOOLCHAIN=1.93.0
if [ -n "${TZ_GIT_MIRRORS:-}" ]; then
  export CARGO_NET_GIT_FETCH_WITH_CLI=true GIT_CONFIG_COUNT=2
  export GIT_CONFIG_KEY_0="url.file://$TZ_GIT_MIRRORS/hyperium+mime/repo.insteadOf"
  export GIT_CONFIG_VALUE_0=https://github.com/hyperium/mime
  export GIT_CONFIG_KEY_1="url.file://$TZ_GIT_MIRRORS/tensorzero+durable/repo.insteadOf"
  export GIT_CONFIG_VALUE_1=https://github.com/tensorzero/durable
fi
nice -n 19 cargo fetch --locked >&2
nice -n 19 cargo build --release --locked --offline -j 2 -p gateway --bin gateway >&2
echo "$CARGO_TARGET_DIR/release/gateway"
