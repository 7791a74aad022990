#!/usr/bin/env bash
# A Docker engine and a Python base image for building keras_ps' image on a
# machine that has neither, e.g. CI (.ci/run) and tests/system/test_docker.py.
#
#   docker/engine.sh start        # make an engine answer (root on Debian: installs
#                                 # docker.io, docker-compose and debootstrap once,
#                                 # starts dockerd); exit 3 when it cannot
#   docker/engine.sh stop         # stop the dockerd that `start` started, if any
#   docker/engine.sh base-image   # print the image to build FROM (PYTHON_IMAGE):
#                                 # the Dockerfile's pinned python image when the
#                                 # engine has it or can pull it, else a local
#                                 # Debian base built with debootstrap (kept in
#                                 # the engine and reused)
#   docker/engine.sh build [TAG]  # build keras_ps' image (keras_ps:dev) FROM base-image
#   docker/engine.sh sources      # what base-image would read (apt mirror, pip files)
#   docker/engine.sh compose ARGS # run Compose: `docker compose` (v2) if the
#                                 # client has it, else `docker-compose`
#
# The local base image is a minimal Debian (the machine's own release when it
# is Debian, else bookworm) from the mirror this machine's apt uses, with
# python3, venv, pip and a `python` link, and this machine's pip configuration
# files (the ones `pip config debug` lists, and the files they name, such as
# the CA bundle and constraints) at the same paths, so that pip inside the
# build reaches the package index this machine reaches. Nothing here names a
# host: mirror and index are read from the machine's configuration.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
STATE_DIR="${KERAS_PS_ENGINE_STATE:-/run/keras_ps-engine}"
PIDFILE="$STATE_DIR/dockerd.pid"
LOGFILE="$STATE_DIR/dockerd.log"
LOCAL_BASE="${KERAS_PS_LOCAL_BASE:-keras_ps-base:local}"

log() { echo "engine.sh: $*" >&2; }

engine_answers() { timeout 20 docker info >/dev/null 2>&1; }

cmd_start() {
  if command -v docker >/dev/null && engine_answers; then
    log "a Docker engine answers already"
    return 0
  fi
  if [[ "$(id -u)" != 0 || ! -f /etc/debian_version ]] || ! command -v apt-get >/dev/null; then
    log "no Docker engine answers and none can be started here (it takes root on" \
        "Debian: docker.io, docker-compose and debootstrap from apt)."
    return 3
  fi
  local missing=()
  command -v dockerd >/dev/null || missing+=(docker.io)
  command -v docker-compose >/dev/null || missing+=(docker-compose)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  if ((${#missing[@]})); then
    log "installing ${missing[*]} (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >&2
    apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
  fi
  mkdir -p "$STATE_DIR"
  # No iptables and no default bridge: neither works in every sandbox.
  # User-defined networks (Compose's) still work, with DNS between services.
  log "starting dockerd (log: $LOGFILE)"
  setsid dockerd --iptables=false --bridge=none >"$LOGFILE" 2>&1 </dev/null &
  echo $! >"$PIDFILE"
  local deadline=$((SECONDS + 60))
  until engine_answers; do
    if ! kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
      log "dockerd exited; the end of its log:"
      tail -20 "$LOGFILE" >&2
      rm -f "$PIDFILE"
      return 1
    fi
    if ((SECONDS > deadline)); then
      log "dockerd did not answer within 60 s; the end of its log:"
      tail -20 "$LOGFILE" >&2
      return 1
    fi
    sleep 0.5
  done
  log "dockerd is up (pid $(cat "$PIDFILE"))"
}

cmd_stop() {
  [[ -f "$PIDFILE" ]] || { log "no dockerd started by this script"; return 0; }
  local pid
  pid="$(cat "$PIDFILE")"
  if [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == dockerd ]]; then
    kill -TERM "$pid"
    local deadline=$((SECONDS + 60))
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && { log "dockerd $pid ignored SIGTERM: SIGKILL"; kill -KILL "$pid"; }
  fi
  rm -f "$PIDFILE"
  log "dockerd $pid stopped"
}

# The Debian archive this machine's apt uses: "URI SUITE KEYRING" of the first
# deb entry for a plain release suite (not -updates or -security).
apt_mirror() {
  python3 - <<'EOF'
import glob, re
entries = []
def add(types, uris, suites, signed_by):
    if "deb" in types:
        for uri in uris:
            for suite in suites:
                entries.append((uri, suite, signed_by))
for path in ["/etc/apt/sources.list"] + sorted(glob.glob("/etc/apt/sources.list.d/*.list")):
    try:
        lines = open(path).read().splitlines()
    except OSError:
        continue
    for line in lines:
        line = line.split("#", 1)[0].strip()
        m = re.match(r"(deb)\s+(\[[^\]]*\]\s+)?(\S+)\s+(\S+)", line)
        if m:
            key = re.search(r"signed-by=(\S+?)[\s\]]", m.group(2) or "")
            add(["deb"], [m.group(3)], [m.group(4)], key.group(1) if key else "")
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    for stanza in re.split(r"\n\s*\n", open(path).read()):
        fields = {}
        for line in stanza.splitlines():
            if line.startswith("#") or ":" not in line or line[0].isspace():
                continue
            k, v = line.split(":", 1)
            fields[k.strip().lower()] = v.split()
        if fields.get("enabled", ["yes"])[0] == "no":
            continue
        add(fields.get("types", []), fields.get("uris", []), fields.get("suites", []),
            (fields.get("signed-by") or [""])[0])
for uri, suite, key in entries:
    if re.fullmatch(r"[a-z]+", suite) and "security" not in uri:
        print(uri, suite, key)
        break
EOF
}

# Files pip reads on this machine: its configuration files and the files they
# (or PIP_* variables) name, e.g. the CA bundle and a constraints file.
pip_files() {
  python3 -m pip config debug 2>/dev/null | python3 -c '
import os, re, sys
files = []
for line in sys.stdin:
    m = re.match(r"\s*(\S+), exists: True", line)
    if m:
        files.append(m.group(1))
        continue
    m = re.match(r"\s*(?:[\w.-]+: |PIP_\w+=.)(.+?)\x27?$", line)
    if m:
        for value in m.group(1).split():
            if value.startswith("/") and os.path.isfile(value):
                files.append(value)
print("\n".join(dict.fromkeys(files)))'
}

# PIP_* variables of this environment, as ENV lines for the imported image.
pip_env_changes() {
  python3 -c '
import json, os
for k, v in sorted(os.environ.items()):
    if k.startswith("PIP_"):
        print("--change")
        print(f"ENV {k}={json.dumps(v)}")'
}

image_exists() { docker image inspect "$1" >/dev/null 2>&1; }

cmd_base_image() {
  local pinned
  pinned="$(sed -n 's/^ARG PYTHON_IMAGE=//p' "$HERE/Dockerfile")"
  if image_exists "$pinned" || timeout 120 docker pull -q "$pinned" >/dev/null 2>&1; then
    echo "$pinned"
    return 0
  fi
  if image_exists "$LOCAL_BASE"; then
    log "$pinned cannot be pulled; reusing the local base $LOCAL_BASE"
    echo "$LOCAL_BASE"
    return 0
  fi
  command -v debootstrap >/dev/null || { log "$pinned cannot be pulled and debootstrap is missing (apt-get install debootstrap)"; return 1; }
  local mirror uri suite key release
  mirror="$(apt_mirror)"
  [[ -n "$mirror" ]] || { log "no Debian archive found in this machine's apt sources"; return 1; }
  read -r uri suite key <<<"$mirror"
  release="$(. /etc/os-release 2>/dev/null; [[ "${ID:-}" == debian ]] && echo "${VERSION_CODENAME:-}")"
  release="${release:-bookworm}"
  log "$pinned cannot be pulled; building $LOCAL_BASE: Debian $release from this machine's apt mirror (a few minutes, once)"
  rootfs="$(mktemp -d /var/tmp/keras_ps-rootfs.XXXXXX)"
  trap 'rm -rf "$rootfs"' EXIT
  local keyring=()
  [[ -n "$key" && -f "$key" ]] && keyring=(--keyring "$key")
  debootstrap --variant=minbase "${keyring[@]}" \
    --include=python3,python3-venv,python3-pip,ca-certificates \
    "$release" "$rootfs" "$uri" >&2
  ln -sf python3 "$rootfs/usr/bin/python"
  local f
  while IFS= read -r f; do
    [[ -n "$f" ]] || continue
    mkdir -p "$rootfs$(dirname "$f")"
    cp -L "$f" "$rootfs$f"
  done < <(pip_files)
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  local changes=()
  mapfile -t changes < <(pip_env_changes)
  tar -C "$rootfs" -c . | docker import "${changes[@]}" \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$LOCAL_BASE" >&2
  log "built $LOCAL_BASE"
  echo "$LOCAL_BASE"
}

cmd_build() {
  local tag="${1:-keras_ps:dev}" base
  base="$(cmd_base_image)"
  log "building $tag FROM $base"
  # Host network: the build's pip reaches the index as this machine does
  # (the engine may run without a default bridge).
  docker build --network host --build-arg "PYTHON_IMAGE=$base" \
    -f "$HERE/Dockerfile" -t "$tag" "$HERE/.." >&2
  echo "$tag"
}

cmd_compose() {
  if docker compose version >/dev/null 2>&1; then
    exec docker compose "$@"
  fi
  exec docker-compose "$@"
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  base-image) cmd_base_image ;;
  build) shift; cmd_build "$@" ;;
  compose) shift; cmd_compose "$@" ;;
  sources) echo "apt: $(apt_mirror)"; echo "pip files:"; pip_files; pip_env_changes ;;
  *) echo "usage: docker/engine.sh start | stop | base-image | build [TAG] | sources | compose ARGS" >&2; exit 2 ;;
esac
