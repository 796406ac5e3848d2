#!/usr/bin/env bash
# Prepare a ttnn runtime that drives Tenstorrent's functional simulator (ttsim), in the
# CPython 3.12 side environment (scripts/ensure_env.sh ttnn). Cached outside the repo.
#
#   scripts/ttsim_env.sh            build or reuse; prints the manifest path on the last line
#   scripts/ttsim_env.sh --check    also open each simulated device once (smoke test)
#   scripts/ttsim_env.sh --env tt   for the Tenstorrent decode environment (ensure_env.sh tt:
#                                   vLLM 0.25.1 + vllm-tt-plugin) instead of the ttnn one
#
# Inputs (environment):
#   HAWK_TTSIM_DIR  folder with the simulator libraries, either laid out as
#                   bh/libttsim.so + wh/libttsim.so (a build from ttsim's source) or as
#                   libttsim_bh.so + libttsim_wh.so (ttsim's GitHub release assets).
#                   Default: ../shared/ttsim next to this checkout (or next to the main
#                   checkout of a git worktree) when present.
#   HAWK_SFPI_DIR   a real SFPI toolchain (folder holding compiler/bin/riscv-tt-elf-g++).
#                   Default: /opt/tenstorrent/sfpi, or the wheel's ttnn/runtime/sfpi.
#   HAWK_CACHE      cache root (default ~/.cache/vllm-hawk).
#
# Output: $HAWK_CACHE/ttsim-<key>/ with
#   sim/bh, sim/wh   libttsim.so (symlink) + soc_descriptor.yaml (from the wheel), the
#                    folder layout tt-metal wants for TT_METAL_SIMULATOR
#   root/            a TT_METAL_RUNTIME_ROOT mirroring the wheel's tt_metal/ and runtime/
#   manifest.json    python, runtime root, simulator per arch, sfpi "real"|"stand-in",
#                    what runs ("capabilities"), and the env vars to set
#
# Without SFPI (the usual case here: the toolchain is not in the wheel, on PyPI or in
# Debian) the documented no-compiler work-around is applied (shared/ttsim/README.md):
# a stand-in riscv-tt-elf-g++ that only answers --version with the string recorded in the
# wheel's precompiled firmware, and aliases for the firmware keys the simulator asks for.
# Then device open, DRAM/L1 interleaved tensors, host<->device copies and buffer
# addresses work; NO kernel runs (no compute: attention, matmul, paged_update_cache;
# data-movement ops also need the compiler). With a real SFPI toolchain it is linked in
# instead and kernels can be compiled (not exercised on this machine).
set -euo pipefail
t0=$(date +%s%N)
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${HAWK_CACHE:-$HOME/.cache/vllm-hawk}
log() { echo "[hawk-ttsim] $*" >&2; }
REV=1  # bump when the layout built below changes
SFPI_VERSION_STRING='riscv-tt-elf-g++ (tenstorrent/sfpi:7.89.0[1050]) 15.1.0'
# precompiled-firmware aliases for ttnn 0.81.1: key the simulator asks for -> shipped key
# (chosen by matching ELF bank-table sizes: BH 130 L1 / 8 DRAM banks, WH 72 / 12)
ALIASES_0_81_1="2906205993819637780:11660721212704224774 2752194815558545679:1003041148146844629"

check=0
env_kind=ttnn
while [ $# -gt 0 ]; do
    case "$1" in
        --check) check=1 ;;
        --env) env_kind=$2; shift ;;
        *) log "usage: $0 [--check] [--env ttnn|tt]"; exit 2 ;;
    esac
    shift
done

# ---- simulator libraries ---------------------------------------------------------------
simdir=${HAWK_TTSIM_DIR:-}
if [ -z "$simdir" ]; then
    common=$(git -C "$here" rev-parse --path-format=absolute --git-common-dir 2>/dev/null || true)
    for c in "$here/../shared/ttsim" ${common:+"$(dirname "$common")/../shared/ttsim"}; do
        if [ -d "$c" ]; then simdir=$(cd "$c" && pwd); break; fi
    done
fi
if [ -z "$simdir" ] || [ ! -d "$simdir" ]; then
    log "no simulator: set HAWK_TTSIM_DIR to a folder with bh/libttsim.so and wh/libttsim.so,"
    log "or with libttsim_bh.so and libttsim_wh.so from https://github.com/tenstorrent/ttsim/releases"
    exit 3
fi
declare -A lib
for arch in bh wh; do
    for cand in "$simdir/$arch/libttsim.so" "$simdir/libttsim_$arch.so"; do
        if [ -f "$cand" ]; then lib[$arch]=$(readlink -f "$cand"); break; fi
    done
    if [ -z "${lib[$arch]:-}" ]; then
        log "HAWK_TTSIM_DIR=$simdir: no $arch/libttsim.so or libttsim_$arch.so"; exit 3
    fi
done

# ---- ttnn side environment ---------------------------------------------------------------
py=$(bash "$here/scripts/ensure_env.sh" "$env_kind" | tail -n 1)
wheel=$("$py" -c 'import importlib.util as u, os; print(os.path.dirname(u.find_spec("ttnn").origin))')
ttnn_version=$("$py" -c 'from importlib.metadata import version; print(version("ttnn"))')

# ---- SFPI: real toolchain or the stand-in -----------------------------------------------
sfpi=""
for c in ${HAWK_SFPI_DIR:-} /opt/tenstorrent/sfpi "$wheel/runtime/sfpi"; do
    # a real toolchain ships its headers (lltt.h etc.) beside the compiler; the stand-in does not
    if [ -x "$c/compiler/bin/riscv-tt-elf-g++" ] && [ -d "$c/include" ] \
        && "$c/compiler/bin/riscv-tt-elf-g++" --version >/dev/null 2>&1; then
        sfpi=$(cd "$c" && pwd); break
    fi
done
sfpi_kind=${sfpi:+real}
sfpi_kind=${sfpi_kind:-stand-in}

key=$( (echo "rev=$REV ttnn=$ttnn_version wheel=$wheel sfpi=${sfpi:-none} libs=${lib[bh]}:${lib[wh]}"; sha256sum "${lib[bh]}" "${lib[wh]}") | sha256sum | cut -c1-12)
out="$cache/ttsim-$key"
if [ ! -f "$out/manifest.json" ]; then
    mkdir -p "$cache"
    exec 8>"$out.lock"
    flock 8
fi
if [ ! -f "$out/manifest.json" ]; then
    log "building $out (simulators from $simdir, SFPI: $sfpi_kind)"
    rm -rf "$out.tmp"; mkdir -p "$out.tmp/sim/bh" "$out.tmp/sim/wh" "$out.tmp/root/tt_metal" "$out.tmp/root/runtime"
    ln -s "${lib[bh]}" "$out.tmp/sim/bh/libttsim.so"
    ln -s "${lib[wh]}" "$out.tmp/sim/wh/libttsim.so"
    cp "$wheel/tt_metal/soc_descriptors/blackhole_140_arch.yaml" "$out.tmp/sim/bh/soc_descriptor.yaml"
    cp "$wheel/tt_metal/soc_descriptors/wormhole_b0_80_arch.yaml" "$out.tmp/sim/wh/soc_descriptor.yaml"
    # runtime root: symlink every entry of the wheel's folders, except the two we extend
    for e in "$wheel"/tt_metal/*; do
        [ "$(basename "$e")" = pre-compiled ] || ln -s "$e" "$out.tmp/root/tt_metal/"
    done
    mkdir "$out.tmp/root/tt_metal/pre-compiled"
    for e in "$wheel"/tt_metal/pre-compiled/*; do ln -s "$e" "$out.tmp/root/tt_metal/pre-compiled/"; done
    for e in "$wheel"/runtime/*; do
        [ "$(basename "$e")" = sfpi ] || ln -s "$e" "$out.tmp/root/runtime/"
    done
    if [ "$sfpi_kind" = real ]; then
        ln -s "$sfpi" "$out.tmp/root/runtime/sfpi"
    else
        if [ "$ttnn_version" != 0.81.1 ]; then
            log "WARNING: firmware aliases are known for ttnn 0.81.1 only (found $ttnn_version); device open may fail"
        fi
        for a in $ALIASES_0_81_1; do
            from=${a%%:*}; to=${a##*:}
            if [ -d "$wheel/tt_metal/pre-compiled/$to" ] && [ ! -e "$out.tmp/root/tt_metal/pre-compiled/$from" ]; then
                ln -s "$wheel/tt_metal/pre-compiled/$to" "$out.tmp/root/tt_metal/pre-compiled/$from"
            fi
        done
        bin="$out.tmp/root/runtime/sfpi/compiler/bin"
        mkdir -p "$bin"
        cat >"$bin/riscv-tt-elf-g++" <<EOF
#!/bin/sh
# Stand-in for the SFPI compiler (vllm-hawk scripts/ttsim_env.sh): answers --version only,
# so tt-metal accepts the precompiled firmware. It compiles nothing.
case "\$1" in --version) echo '$SFPI_VERSION_STRING'; exit 0;; esac
echo "riscv-tt-elf-g++ stand-in: no SFPI toolchain here, kernels cannot be compiled (vllm-hawk scripts/ttsim_env.sh)" >&2
exit 1
EOF
        chmod +x "$bin/riscv-tt-elf-g++"
        for t in gcc cpp as ld objcopy objdump readelf nm strip size ar; do
            ln -s riscv-tt-elf-g++ "$bin/riscv-tt-elf-$t"
        done
    fi
    if [ "$sfpi_kind" = real ]; then
        caps='["device open", "DRAM/L1 interleaved tensors", "host<->device copies", "buffer addresses", "kernels (compiled with the real SFPI toolchain; not exercised by vllm-hawk tests)"]'
        nocaps='[]'
    else
        caps='["device open", "DRAM/L1 interleaved tensors", "host<->device copies (tilize on the host)", "buffer addresses (allocator)"]'
        nocaps='["any device kernel: compute (paged_update_cache, paged SDPA decode attention, matmul) and data movement (paged_fill_cache) need the SFPI toolchain"]'
    fi
    cat >"$out.tmp/manifest.json" <<EOF
{
 "python": "$py",
 "ttnn_version": "$ttnn_version",
 "wheel": "$wheel",
 "runtime_root": "$out/root",
 "simulator_dir": "$simdir",
 "simulators": {"blackhole": "$out/sim/bh/libttsim.so", "wormhole_b0": "$out/sim/wh/libttsim.so"},
 "sfpi": "$sfpi_kind",
 "sfpi_path": "${sfpi:-$out/root/runtime/sfpi}",
 "capabilities": $caps,
 "not_possible": $nocaps,
 "env": {"TT_METAL_RUNTIME_ROOT": "$out/root", "TT_METAL_SLOW_DISPATCH_MODE": "1",
         "TT_METAL_CACHE": "$out/cache", "TT_LOGGER_LEVEL": "error"}
}
EOF
    rm -rf "$out"; mv "$out.tmp" "$out"
fi

if [ "$check" = 1 ]; then
    for arch in bh wh; do
        env TT_METAL_RUNTIME_ROOT="$out/root" TT_METAL_SLOW_DISPATCH_MODE=1 TT_METAL_CACHE="$out/cache" \
            TT_LOGGER_LEVEL=error TT_METAL_SIMULATOR="$out/sim/$arch/libttsim.so" \
            "$py" -c 'import ttnn, time; t=time.time(); d=ttnn.open_device(device_id=0); g=d.dram_grid_size(); ttnn.close_device(d); print(f"'"$arch"': open+close {time.time()-t:.2f} s, DRAM grid {g.x}x{g.y}")' >&2
    done
fi
log "SFPI: $sfpi_kind; $(if [ "$sfpi_kind" = real ]; then echo "kernels can be compiled"; else echo "device open, DRAM tensors, copies and addresses work; NO kernel (compute or data movement) can run"; fi)"
ms=$(( ($(date +%s%N) - t0) / 1000000 ))
log "ready in $((ms / 1000)).$(printf '%03d' $((ms % 1000))) s: $out"
echo "$out/manifest.json"
