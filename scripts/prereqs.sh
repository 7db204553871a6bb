# Sourced by scripts/main.sh and scripts/test.sh: installs the system packages a fresh
# machine of this kind lacks. Usage: prereqs COMMAND:PACKAGE...
prereqs() {
  local need=() pair
  for pair in "$@"; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair#*:}")
  done
  if [ ${#need[@]} -gt 0 ]; then
    echo "installing: ${need[*]}" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  fi
}
