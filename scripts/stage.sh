#!/usr/bin/env bash
# stage.sh NAME CMD...: run CMD, then print "[stage] NAME: N s (exit RC)" to stderr.
# `make test` wraps every stage in it so a CI log shows where the time goes.
set -u
name=$1; shift
t0=$(date +%s.%N)
"$@"
rc=$?
dt=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
printf '[stage] %s: %s s%s\n' "$name" "$dt" "$([ $rc = 0 ] || echo " (exit $rc)")" >&2
exit $rc
