# Sourced by scripts/check-deploy.sh and scripts/test-k8s.sh: the versions the deployment
# files are checked and applied against, and how a Go module is fetched.
KUBERNETES_VERSION=1.32.0          # the API the manifests are checked and applied against
KEDA_VERSION=v2.21.0
PROMETHEUS_OPERATOR_VERSION=v0.85.0

# A Go module's directory in the module cache, downloaded through the module proxy.
go_module_dir() {
  (cd /tmp && go mod download -json "$1") |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])'
}
