#!/usr/bin/env bash
# Install what kernel_driver/ needs to build and check on Debian 12 (bookworm),
# idempotently (skips whatever is already there). Run as root; non-interactive.
#
#   scripts/kernel_deps.sh          Debian 6.1 and 6.12 amd64 headers, sparse, gcc, make;
#                                   for the QEMU guest stages: qemu-system-x86, debootstrap,
#                                   busybox-static, cpio, zstd, xz-utils, the 6.12 image
#
# Where the headers come from: bookworm's main/security suites carry both the 6.1
# series (linux-headers-amd64) and, since the 6.12 LTS backport into bookworm,
# the 6.12 series (linux-headers-6.12-amd64, a meta package from linux-signed-6.12).
# No backports or trixie sources are needed. The 6.12 headers package depends on
# its kernel image (~107 MB); INITRD=No keeps the image's postinst from building
# an initramfs, which nothing here needs.
# Progress goes to stderr.
set -euo pipefail
log() { echo "[kernel-deps] $*" >&2; }

for a in "$@"; do
    case $a in
        -h|--help) sed -n '2,13p' "$0" >&2; exit 0 ;;
        *) log "unknown argument: $a"; exit 2 ;;
    esac
done

have_headers() {  # have_headers 6.1 -> true if a /usr/src/linux-headers-6.1.*-amd64 tree exists
    compgen -G "/usr/src/linux-headers-$1.*-amd64/Makefile" >/dev/null
}

need=()
have_headers 6.1 || need+=(linux-headers-amd64)
have_headers 6.12 || need+=(linux-headers-6.12-amd64)
command -v sparse >/dev/null || need+=(sparse)
command -v gcc >/dev/null || need+=(gcc)
command -v make >/dev/null || need+=(make)
# the QEMU guest stages (tests/guest, scripts/qemu_guest.py): boot the 6.12 image above
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v cpio >/dev/null || need+=(cpio)
command -v zstd >/dev/null || need+=(zstd)
command -v xz >/dev/null || need+=(xz-utils)
{ [ -x /bin/busybox ] && ! head -c 4096 /bin/busybox | grep -qa ld-linux; } || need+=(busybox-static)  # static: no PT_INTERP
compgen -G "/boot/vmlinuz-6.12.*-amd64" >/dev/null || need+=(linux-image-6.12-amd64)
# libasan/libubsan come with gcc-12's libgcc-12-dev on bookworm.

if [ ${#need[@]} -eq 0 ]; then
    log "all present: $(ls -d /usr/src/linux-headers-6.1*-amd64 2>/dev/null | xargs -n1 basename | tr '\n' ' ')sparse $(sparse --version 2>/dev/null)"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    log "need root to install: ${need[*]}"
    exit 1
fi

start=$(date +%s)
log "apt-get install ${need[*]}"
"$(dirname "${BASH_SOURCE[0]}")/apt_install.sh" "${need[@]}"
have_headers 6.1 || { log "6.1 headers still missing"; exit 1; }
have_headers 6.12 || { log "6.12 headers still missing"; exit 1; }
log "done in $(( $(date +%s) - start ))s: $(ls -d /usr/src/linux-headers-6.1*-amd64 | xargs -n1 basename | tr '\n' ' ')"
