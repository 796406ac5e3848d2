#!/usr/bin/env bash
# apt_install.sh PKG...: apt-get update + install, waiting for the apt locks instead of failing.
#
# On a fresh machine another apt-get (the image's boot-time update, or a second `make`
# prerequisite running in the background) may hold /var/lib/apt/lists/lock; apt-get then
# exits with "Could not get lock". Our own callers serialise on one flock, and apt waits
# up to APT_LOCK_TIMEOUT_S (default 600) for anyone else's: DPkg::Lock::Timeout covers
# the dpkg lock of `install`, but apt 2.6's `update` does not wait for the lists lock, so
# `update` is retried while that lock is held.
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: $0 PKG..." >&2; exit 2; }
t=${APT_LOCK_TIMEOUT_S:-600}
exec 9>/var/lock/vllm-hawk-apt.lock
flock -w "$t" 9 || { echo "apt_install: another vllm-hawk apt-get held /var/lock/vllm-hawk-apt.lock for ${t}s" >&2; exit 1; }
deadline=$(( $(date +%s) + t ))
until err=$(apt-get update -qq 2>&1 >/dev/null); do
    if ! grep -q "Could not get lock" <<<"$err" || [ "$(date +%s)" -ge "$deadline" ]; then
        echo "$err" >&2; exit 1
    fi
    sleep 2
done
DEBIAN_FRONTEND=noninteractive INITRD=No apt-get -o DPkg::Lock::Timeout="$t" install -y -qq \
    --no-install-recommends -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "$@" >&2
