#!/usr/bin/env bash
# Makes, on a machine that can pull from no image registry, the base images that
# deploy/docker/Dockerfile and docker-compose.yml name, from what the package registries
# serve, then builds sluice's image with the real Dockerfile:
#
#   debian:trixie-slim             Debian trixie, minbase, from Debian's packages (mmdebstrap)
#   rust:1.95-trixie               the same plus gcc/make/git/pkg-config, and THIS machine's Rust
#                                  1.95 toolchain (rustup cannot download one here) under
#                                  /usr/local/rustup + /usr/local/cargo as in Docker Hub's image
#   apachepulsar/pulsar:4.0.8      Debian trixie + openjdk-21-jre-headless + python3 + Apache
#                                  Pulsar 4.0.8's distribution from Maven Central, in /pulsar,
#                                  user 10000, as in Docker Hub's image, with sluice's own
#                                  bin/apply-config-from-env.py (tests/stack/pulsar/)
#   sluice-local/prometheus:debian Debian trixie's `prometheus` package (Prometheus 2.x, NOT
#                                  Docker Hub's prom/prometheus:v3.5.0; the stack test names it
#                                  in its override file), entrypoint /usr/bin/prometheus
#   sluice:local                   `docker build -f deploy/docker/Dockerfile .`, unchanged; or, with
#                                  SLUICE_IMAGE_BINARY=path (the test command: its own debug
#                                  build), the Dockerfile's runtime stage with that binary
#
# Usage: scripts/stack-images.sh [bases|prometheus|sluice|all]   (default all)
#
# Each base is labelled with a hash of its recipe and rebuilt only when the recipe changes;
# Docker's image store (/var/lib/docker) is the cache, outside the clone. The sluice image is
# built by the legacy builder (no buildx here): its layer cache keeps the dependency layer
# (`cargo chef cook`) until Cargo.toml or Cargo.lock change. Needs a running dockerd and root
# (mmdebstrap's root mode).
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$(dirname "$0")/.."

MIRROR="${SLUICE_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SECURITY_MIRROR="${SLUICE_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
# The versions the Dockerfile and docker-compose.yml name (read from them, so they cannot drift).
RUST_VERSION=$(sed -n 's/^ARG RUST_VERSION=//p' deploy/docker/Dockerfile)
DEBIAN_RELEASE=$(sed -n 's/^ARG DEBIAN_RELEASE=//p' deploy/docker/Dockerfile)
PULSAR_IMAGE=$(sed -n 's/^ *image: *\(apachepulsar\/pulsar:.*\)$/\1/p' docker-compose.yml)
PULSAR_VERSION="${PULSAR_IMAGE##*:}"
PROMETHEUS_IMAGE=sluice-local/prometheus:debian
SLUICE_IMAGE="${SLUICE_IMAGE:-sluice:local}"

LOG_TAG="stack-images"

[ -n "$RUST_VERSION" ] && [ -n "$DEBIAN_RELEASE" ] && [ -n "$PULSAR_VERSION" ] || {
  log "could not read RUST_VERSION/DEBIAN_RELEASE from the Dockerfile or Pulsar's image from docker-compose.yml"
  exit 1
}

. scripts/prereqs.sh
prereqs mmdebstrap:mmdebstrap

# The recipe hash an image was made from, or nothing.
recipe_of() { docker image inspect -f '{{index .Config.Labels "sluice.recipe"}}' "$1" 2>/dev/null || true; }

# mmdebstrap's sources: the release, its updates and its security archive, as Docker Hub's
# Debian images have them.
sources=(
  "deb $MIRROR $DEBIAN_RELEASE main"
  "deb $MIRROR $DEBIAN_RELEASE-updates main"
  "deb $SECURITY_MIRROR $DEBIAN_RELEASE-security main"
)
# Without documentation, man pages, translations or apt's lists: what "slim" means.
slim_opts=(
  --aptopt='Acquire::Languages "none"'
  --dpkgopt='path-exclude=/usr/share/doc/*'
  --dpkgopt='path-include=/usr/share/doc/*/copyright'
  --dpkgopt='path-exclude=/usr/share/man/*'
  --dpkgopt='path-exclude=/usr/share/locale/*'
  --dpkgopt='path-include=/usr/share/locale/locale.alias'
  # Java's postinst registers its man page with update-alternatives, which fails when the
  # directory is missing (Docker Hub's slim images create it for the same reason).
  --setup-hook='mkdir -p "$1/usr/share/man/man1"'
  --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin'
)

# make_base IMAGE RECIPE-TEXT -- mmdebstrap-args... -- docker-import-changes...
# Builds IMAGE unless it exists with the same recipe. The recipe text is everything that
# shapes the image (arguments and inputs), hashed into the label.
make_base() {
  local image="$1" recipe="$2"
  shift 2
  local hash
  hash=$(printf '%s\n' "$recipe" "${sources[@]}" | sha256sum | cut -c1-16)
  if [ "$(recipe_of "$image")" = "$hash" ]; then
    log "$image: up to date ($hash)"
    return 0
  fi
  local mm=() changes=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do mm+=("$1"); shift; done
  shift || true
  while [ $# -gt 0 ]; do changes+=(--change "$1"); shift; done
  log "$image: building from Debian $DEBIAN_RELEASE packages"
  local start=$SECONDS tmp
  tmp=$(mktemp -d)
  # Through a file rather than a pipe, so that a failed mmdebstrap never leaves a
  # half-made image under the name.
  if ! mmdebstrap --quiet --format=tar "${slim_opts[@]}" "${mm[@]}" "$DEBIAN_RELEASE" "$tmp/rootfs.tar" \
      "${sources[@]}" 2>"$tmp/log"; then
    tail -n 30 "$tmp/log" >&2
    rm -rf "$tmp"
    log "$image: mmdebstrap failed"
    return 1
  fi
  docker import "${changes[@]}" --change "LABEL sluice.recipe=$hash" "$tmp/rootfs.tar" "$image" >/dev/null
  rm -rf "$tmp"
  log "$image: built in $((SECONDS - start)) s"
}

# The host's Rust toolchain of the Dockerfile's RUST_VERSION (rustc X.Y.*), without its
# documentation.
rust_toolchain() {
  local sysroot
  sysroot=$(rustc --print sysroot 2>/dev/null) || { log "no rustc here"; return 1; }
  local v
  v=$("$sysroot/bin/rustc" --version | awk '{print $2}')
  case "$v" in
    "$RUST_VERSION" | "$RUST_VERSION".*) ;;
    *) log "the host's rustc is $v; the Dockerfile wants $RUST_VERSION"; return 1 ;;
  esac
  echo "$sysroot $v"
}

rust_base() {
  local sysroot rust_full
  read -r sysroot rust_full < <(rust_toolchain)
  local toolchain="$rust_full-x86_64-unknown-linux-gnu"
  # Docker Hub's rust image: RUSTUP_HOME=/usr/local/rustup, CARGO_HOME=/usr/local/cargo, its
  # bin first on PATH. The toolchain's binaries are linked there in place of rustup's proxies.
  # This machine reaches crates.io through an HTTPS proxy with its own certificate
  # authority: the builder trusts the CAs the host added (/usr/local/share/ca-certificates),
  # as the host's cargo does. Only this build-time image carries them, never sluice's image.
  local cas
  cas=$(cat /usr/local/share/ca-certificates/*.crt 2>/dev/null | sha256sum | cut -c1-16)
  make_base "rust:$RUST_VERSION-$DEBIAN_RELEASE" "rust v1 $rust_full cas $cas" \
    --variant=minbase \
    --include=ca-certificates,curl,git,gcc,g++,libc6-dev,make,pkg-config,binutils,xz-utils,libssl-dev \
    --customize-hook='for c in /usr/local/share/ca-certificates/*.crt; do [ -f "$c" ] && cp "$c" "$1/usr/local/share/ca-certificates/"; done; chroot "$1" update-ca-certificates >/dev/null' \
    --customize-hook="mkdir -p \"\$1/usr/local/rustup/toolchains/$toolchain\" \"\$1/usr/local/cargo/bin\"" \
    --customize-hook="tar -C '$sysroot' --exclude=./share/doc -cf - . | tar -C \"\$1/usr/local/rustup/toolchains/$toolchain\" -xf -" \
    --customize-hook="for b in \"\$1/usr/local/rustup/toolchains/$toolchain\"/bin/*; do ln -s \"/usr/local/rustup/toolchains/$toolchain/bin/\$(basename \"\$b\")\" \"\$1/usr/local/cargo/bin/\"; done" \
    --customize-hook='chmod -R a+w "$1/usr/local/cargo"' \
    -- \
    'ENV RUSTUP_HOME=/usr/local/rustup' 'ENV CARGO_HOME=/usr/local/cargo' \
    'ENV PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    "ENV RUST_VERSION=$rust_full" 'CMD ["bash"]'
}

bases() {
  make_base "debian:$DEBIAN_RELEASE-slim" "slim v1" --variant=minbase -- 'CMD ["bash"]'

  # The builder's base only when the image is built by the Dockerfile's compiling stages.
  [ -n "${SLUICE_IMAGE_BINARY:-}" ] || rust_base

  # Pulsar's distribution: the one deploy/pulsar/pulsar.sh fetches from Maven Central.
  local dist
  dist=$(SLUICE_PULSAR_VERSION="$PULSAR_VERSION" deploy/pulsar/pulsar.sh dist)
  # Docker Hub's image also has bin/apply-config-from-env.py, which docker-compose.yml calls;
  # the distribution has not: tests/stack/pulsar/ holds sluice's own script of that name.
  local apply=tests/stack/pulsar/apply-config-from-env.py
  make_base "$PULSAR_IMAGE" "pulsar v2 $PULSAR_VERSION $(sha256sum <"$apply" | cut -c1-16)" \
    --variant=minbase --include=ca-certificates,openjdk-21-jre-headless,python3,procps \
    --customize-hook="cp -a '$dist' \"\$1/pulsar\"" \
    --customize-hook="install -m 0755 '$PWD/$apply' \"\$1/pulsar/bin/apply-config-from-env.py\"" \
    --customize-hook='mkdir -p "$1/pulsar/data" "$1/pulsar/logs" && chown -R 10000:0 "$1/pulsar" && chmod -R g+w "$1/pulsar"' \
    -- 'WORKDIR /pulsar' 'USER 10000' 'ENV PULSAR_ROOT_LOGGER=INFO,CONSOLE' 'CMD ["bin/pulsar", "standalone"]'

  prometheus_image
}

# Docker Hub's prom/prometheus runs as nobody with its data in /prometheus; the compose
# healthcheck calls wget. Also the Prometheus of scripts/test-k8s-run.sh.
prometheus_image() {
  make_base "$PROMETHEUS_IMAGE" "prometheus v1" \
    --variant=minbase --include=prometheus,wget,ca-certificates \
    --customize-hook='mkdir -p "$1/prometheus" && chown 65534:65534 "$1/prometheus"' \
    -- 'USER 65534:65534' 'WORKDIR /prometheus' 'ENTRYPOINT ["/usr/bin/prometheus"]' \
    'CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]'
}

sluice_image() {
  if [ -n "${SLUICE_IMAGE_BINARY:-}" ]; then
    sluice_image_from_binary "$SLUICE_IMAGE_BINARY"
    return
  fi
  log "$SLUICE_IMAGE: docker build -f deploy/docker/Dockerfile (legacy builder)"
  local start=$SECONDS buildlog since
  since=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  buildlog=$(mktemp)
  # --network host: the build fetches crates and Debian packages; nothing else is reached.
  # The builder stage is tagged too (sluice-builder:cache), so that the prune below never
  # takes its layers (the dependency layer among them) for leftovers.
  if ! { DOCKER_BUILDKIT=0 docker build --network host -f deploy/docker/Dockerfile \
           --target builder -t sluice-builder:cache . &&
         DOCKER_BUILDKIT=0 docker build --network host -f deploy/docker/Dockerfile \
           -t "$SLUICE_IMAGE" .; } >"$buildlog" 2>&1; then
    tail -n 60 "$buildlog" >&2
    rm -f "$buildlog"
    log "$SLUICE_IMAGE: docker build failed"
    return 1
  fi
  rm -f "$buildlog"
  log "$SLUICE_IMAGE: built in $((SECONDS - start)) s"
  # What earlier builds left: untagged images no tag builds on (a former builder stage, a
  # replaced base). Without the builder's tag this would remove the dependency layer too.
  docker image prune -f --filter "until=$since" >/dev/null || true
}

# SLUICE_IMAGE_BINARY=path: the image is the Dockerfile's `runtime` stage (everything of the
# shipped image but the binary, built by the Dockerfile itself: its first stage, so the legacy
# builder makes nothing of Rust) with that binary, stripped, at the same path. The test
# command uses it with the binary of the tests' own build: a release build of the whole
# dependency tree in the Docker builder costs ~15 min of this machine's two cores on a fresh
# machine, past CI's limit. The stages that compile (chef, planner, builder) are then not run.
sluice_image_from_binary() {
  local bin="$1" start=$SECONDS ctx buildlog
  [ -x "$bin" ] || { log "SLUICE_IMAGE_BINARY=$bin is not an executable"; return 1; }
  log "$SLUICE_IMAGE: the Dockerfile's runtime stage + $bin"
  ctx=$(mktemp -d)
  buildlog="$ctx.log"
  # The debug information of a debug build is most of its size (~300 MB of ~350).
  strip --strip-debug -o "$ctx/sluice" "$bin"
  if ! { DOCKER_BUILDKIT=0 docker build --network host -f deploy/docker/Dockerfile \
           --target runtime -t sluice-runtime:cache . &&
         printf 'FROM sluice-runtime:cache\nCOPY sluice /usr/local/bin/sluice\n' |
           DOCKER_BUILDKIT=0 docker build -t "$SLUICE_IMAGE" -f - "$ctx"; } >"$buildlog" 2>&1; then
    tail -n 40 "$buildlog" >&2
    rm -rf "$ctx" "$buildlog"
    log "$SLUICE_IMAGE: docker build failed"
    return 1
  fi
  rm -rf "$ctx" "$buildlog"
  log "$SLUICE_IMAGE: built in $((SECONDS - start)) s"
}

case "${1:-all}" in
  bases) bases ;;
  prometheus) prometheus_image ;;
  sluice) sluice_image ;;
  all) bases; sluice_image ;;
  *) echo "usage: $0 [bases|prometheus|sluice|all]" >&2; exit 2 ;;
esac
