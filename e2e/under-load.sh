#!/usr/bin/env bash
# The suite under load (issue 18): `make test` from a fresh clone of this checkout's HEAD with a
# CPU-burning process beside it, RUNS times in a row; stops at the first failure.
#
#     e2e/under-load.sh [RUNS] [WORKDIR]     (defaults: 3, /tmp/kuberefit-under-load)
#
# Each run's log is WORKDIR/run-N.log; the last line says its exit status and wall time.
set -uo pipefail
runs=${1:-3}
work=${2:-/tmp/kuberefit-under-load}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$work"
bash -c 'while :; do :; done' &
burner=$!
trap 'kill $burner 2>/dev/null' EXIT
for n in $(seq 1 "$runs"); do
    rm -rf "$work/clone"
    git clone -q "$repo" "$work/clone" || exit 1
    log="$work/run-$n.log"
    start=$(date +%s)
    echo "run $n of $runs: $(git -C "$work/clone" rev-parse --short HEAD), $(date -u +%FT%TZ)" | tee "$log"
    (cd "$work/clone" && CI=true make test) >>"$log" 2>&1
    rc=$?
    echo "run $n: exit $rc, $(($(date +%s) - start)) s" | tee -a "$log"
    [ "$rc" -eq 0 ] || exit "$rc"
done
