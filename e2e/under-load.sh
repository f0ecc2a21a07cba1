#!/usr/bin/env bash
# The suite under load (issue 18): `make test` with a CPU-burning process beside it, RUNS times
# in a row; stops at the first failure.
#
#     e2e/under-load.sh [--in-place] [RUNS] [WORKDIR]     (defaults: 3, /tmp/kuberefit-under-load)
#
# Each run is a fresh clone of this checkout's HEAD in WORKDIR (it builds its own venvs), or, with
# --in-place, this checkout itself (its venvs as they are; the tree must not change meanwhile).
# Each run's log is WORKDIR/run-N.log; the last line says its exit status and wall time.
set -uo pipefail
in_place=0
if [ "${1:-}" = "--in-place" ]; then
    in_place=1
    shift
fi
runs=${1:-3}
work=${2:-/tmp/kuberefit-under-load}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$work"
bash -c 'while :; do :; done' &
burner=$!
trap 'kill $burner 2>/dev/null' EXIT
for n in $(seq 1 "$runs"); do
    if [ "$in_place" -eq 1 ]; then
        tree=$repo
    else
        tree=$work/clone
        rm -rf "$tree"
        git clone -q "$repo" "$tree" || exit 1
    fi
    log="$work/run-$n.log"
    start=$(date +%s)
    echo "run $n of $runs: $(git -C "$tree" rev-parse --short HEAD), $(date -u +%FT%TZ)" | tee "$log"
    (cd "$tree" && CI=true make test) >>"$log" 2>&1
    rc=$?
    echo "run $n: exit $rc, $(($(date +%s) - start)) s" | tee -a "$log"
    [ "$rc" -eq 0 ] || exit "$rc"
done
