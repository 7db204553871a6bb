# Sourced by scripts that need a Docker engine (test-stack.sh, test-k8s-run.sh,
# deploy/k8s-local/cluster.sh). docker_up: starts dockerd when none answers (installing
# Debian's docker.io when it is missing), logging to /var/log/sluice-dockerd.log, and sets
# STARTED_DOCKERD to its pid so that the caller can stop it again; returns non-zero when it
# does not come up within 60 s. Uses scripts/lib.sh (sourced here when the caller has not).
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
STARTED_DOCKERD=""
# docker_answers: the Docker engine answers (`docker info`, its output dropped).
docker_answers() { docker info >/dev/null 2>&1; }
# drop_stale_pid_file FILE NAME: removes FILE unless the process it names is a NAME. A dockerd
# killed without its clean-up (a session's end) leaves its pid files behind, and a new one
# believes them when a later process has the same number: it then waits for a containerd that
# is not there ("libcontainerd: containerd is still running", then "timeout waiting for
# containerd to start"; seen in CI).
drop_stale_pid_file() {
  local file=$1 name=$2 pid
  [ -f "$file" ] || return 0
  pid=$(cat "$file" 2>/dev/null || true)
  if [ -z "$pid" ] || [ "$(cat "/proc/$pid/comm" 2>/dev/null)" != "$name" ]; then
    echo "removing $file: pid ${pid:-none} is no $name (left by an engine that was killed)" >&2
    rm -f "$file"
  fi
}
docker_up() {
  docker_answers && return 0
  if ! command -v dockerd >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null
  fi
  drop_stale_pid_file /var/run/docker/containerd/containerd.pid containerd
  drop_stale_pid_file /var/run/docker.pid dockerd
  echo "starting dockerd (log: /var/log/sluice-dockerd.log)" >&2
  nohup dockerd >/var/log/sluice-dockerd.log 2>&1 &
  STARTED_DOCKERD=$!
  WAIT_INTERVAL=1 wait_until 60 "dockerd to answer" docker_answers && return 0
  tail -n 30 /var/log/sluice-dockerd.log >&2
  return 1
}
# docker_down: stops the dockerd that docker_up started, if it did (its images stay).
docker_down() {
  [ -n "$STARTED_DOCKERD" ] || return 0
  kill "$STARTED_DOCKERD" 2>/dev/null || true
  WAIT_INTERVAL=1 wait_gone 30 "dockerd (pid $STARTED_DOCKERD) to exit" "$STARTED_DOCKERD" || true
  STARTED_DOCKERD=""
}
# docker_reap PREFIX SCRIPT: removes what an earlier run of SCRIPT left behind when it was
# killed before its clean-up (a CI job's limit, a session's end): compose projects named
# PREFIX-PID (with the containers on their network, such as a probe started by `docker run`)
# and containers named exactly PREFIX-PID, whose PID is no longer a running SCRIPT. Such
# leftovers come back with the engine (the stack's services restart `unless-stopped`) and
# would run beside this run. Called before the caller makes anything, so a leftover whose
# PID is this shell's own is one too (a PID reused after a restart). Never fails the caller:
# what cannot be removed is said.
docker_reap() {
  local prefix=$1 script=$2 name project
  # left_behind NAME: NAME is PREFIX-PID and PID is not a running SCRIPT other than this
  # shell (a reused pid does not count).
  left_behind() {
    [[ $1 =~ ^$prefix-([0-9]+)$ ]] || return 1
    local pid=${BASH_REMATCH[1]}
    ! { [ "$pid" != "$$" ] && [ -r "/proc/$pid/cmdline" ] &&
      tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "$script"; }
  }
  for project in $(docker ps -a --format '{{.Label "com.docker.compose.project"}}' | sort -u); do
    left_behind "$project" || continue
    echo "removing compose project $project, left behind by a run that did not finish" >&2
    { docker ps -aq --filter "label=com.docker.compose.project=$project"
      docker ps -aq --filter "network=${project}_default"; } | sort -u | xargs -r docker rm -f >/dev/null ||
      echo "could not remove all of $project's containers" >&2
    docker volume ls -q --filter "label=com.docker.compose.project=$project" | xargs -r docker volume rm >/dev/null ||
      echo "could not remove all of $project's volumes" >&2
    docker network ls -q --filter "label=com.docker.compose.project=$project" | xargs -r docker network rm >/dev/null ||
      echo "could not remove all of $project's networks" >&2
  done
  for name in $(docker ps -a --format '{{.Names}}'); do
    left_behind "$name" || continue
    echo "removing container $name, left behind by a run that did not finish" >&2
    docker rm -f "$name" >/dev/null || echo "could not remove container $name" >&2
  done
  return 0
}
