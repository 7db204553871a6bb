# Sourced by scripts/check-deploy.sh and scripts/test-k8s.sh: the versions the deployment
# files are checked and applied against, and how a Go module is fetched.
KUBERNETES_VERSION=1.32.0          # the API the manifests are checked and applied against
KEDA_VERSION=v2.21.0
PROMETHEUS_OPERATOR_VERSION=v0.85.0
METRICS_SERVER_VERSION=v0.8.0     # the resource metrics API (CPU triggers) on the test cluster
COREDNS_VERSION=v1.14.7          # cluster DNS on the test cluster (Service names)

# A Go module's directory in the module cache, downloaded through the module proxy.
go_module_dir() {
  (cd /tmp && go mod download -json "$1") |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])'
}

# k8s_binary NAME: the path of Kubernetes component NAME (kube-apiserver, kubelet, ...) at
# KUBERNETES_VERSION, built from the Go module proxy the first time and cached under
# $SLUICE_CACHE/k8s/bin (no release binaries can be downloaded here). Build output goes to
# stderr only on failure. k8s.io/kubernetes requires its staging modules (k8s.io/api, ...)
# at v0.0.0 and replaces them with ./staging directories, which its module zip does not
# carry; a wrapper module replaces each one that go.mod names with the version published
# for this release (v0.<minor>.<patch>). Go's sum database checks every module fetched.
k8s_binary() {
  local name="$1" cache="${SLUICE_CACHE:-$HOME/.cache/sluice}/k8s"
  local bin="$cache/bin/$name-v$KUBERNETES_VERSION"
  if [ ! -x "$bin" ]; then
    local src gomod staging minor n
    src=$(mktemp -d "${TMPDIR:-/tmp}/sluice-k8s-build.XXXXXX")
    mkdir -p "$cache/bin"
    gomod=$( (cd /tmp && go mod download -json "k8s.io/kubernetes@v$KUBERNETES_VERSION") |
      python3 -c 'import json, sys; print(json.load(sys.stdin)["GoMod"])') || return 1
    staging="v0.${KUBERNETES_VERSION#*.}"
    {
      printf 'module sluice.local/%s\n\ngo 1.23\n\nrequire k8s.io/kubernetes v%s\n\n' "$name" "$KUBERNETES_VERSION"
      sed -nE "s#^[[:space:]]*(replace[[:space:]]+)?(k8s\.io/[^[:space:]]+)[[:space:]]+=>[[:space:]]+\./staging/.*#replace \2 => \2 $staging#p" "$gomod"
    } >"$src/go.mod"
    n=$(grep -c '^replace ' "$src/go.mod") || { echo "no ./staging replacements in $gomod" >&2; rm -rf "$src"; return 1; }
    minor="${KUBERNETES_VERSION#*.}"; minor="${minor%%.*}"
    if ! (cd "$src" && GOFLAGS=-mod=mod go build -trimpath -ldflags "-s -w \
        -X k8s.io/component-base/version.gitVersion=v$KUBERNETES_VERSION \
        -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor" \
        -o "$bin.tmp.$$" "k8s.io/kubernetes/cmd/$name") >"$src/build.log" 2>&1; then
      tail -n 30 "$src/build.log" >&2
      rm -rf "$src" "$bin.tmp.$$"
      echo "building $name v$KUBERNETES_VERSION failed" >&2
      return 1
    fi
    mv "$bin.tmp.$$" "$bin"
    rm -rf "$src"
  fi
  printf '%s\n' "$bin"
}

# go_module_binary MODULE@VERSION PACKAGE NAME [LDFLAGS [PREPARE]]: the path of a static binary
# (CGO off) of PACKAGE (relative to the module, e.g. ./cmd/operator) built from MODULE@VERSION
# as the main module, so that its own go.mod's replace directives apply; cached under
# $SLUICE_CACHE/k8s/bin as NAME-VERSION. PREPARE, a command, is run with the copy of the
# module's source as its argument before the build (a build of fewer parts: name such a
# binary differently). For KEDA and metrics-server (no release binaries or images can be
# downloaded here).
go_module_binary() {
  local mod="$1" pkg="$2" name="$3" ldflags="${4:-}" prepare="${5:-}"
  local cache="${SLUICE_CACHE:-$HOME/.cache/sluice}/k8s"
  local bin="$cache/bin/$name-${mod##*@}"
  if [ ! -x "$bin" ]; then
    local dir src
    dir=$(go_module_dir "$mod") || return 1
    src=$(mktemp -d "${TMPDIR:-/tmp}/sluice-go-build.XXXXXX")
    mkdir -p "$cache/bin"
    cp -r "$dir/." "$src/"
    chmod -R u+w "$src"
    if [ -n "$prepare" ] && ! "$prepare" "$src" >"$src.log" 2>&1; then
      tail -n 30 "$src.log" >&2
      rm -rf "$src" "$src.log"
      echo "preparing $name's source from $mod ($prepare) failed" >&2
      return 1
    fi
    if ! (cd "$src" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w $ldflags" -o "$bin.tmp.$$" "$pkg") \
        >"$src.log" 2>&1; then
      tail -n 30 "$src.log" >&2
      rm -rf "$src" "$src.log" "$bin.tmp.$$"
      echo "building $name from $mod failed" >&2
      return 1
    fi
    mv "$bin.tmp.$$" "$bin"
    rm -rf "$src" "$src.log"
  fi
  printf '%s\n' "$bin"
}
