#!/usr/bin/env bash
# Fetch kubectl v1.20.2 from Debian bookworm's `kubernetes-client` package and cache it.
#
# The tests drive the harness's kube-apiserver (v1.20.2, e2e/build-kube-apiserver.sh) with kubectl; a
# newer kubectl warns about version skew and may use APIs 1.20 lacks. Debian builds `kubernetes-client`
# from the same source package (same Debian release) as the apiserver, so the versions match exactly.
# Fetched with a private apt configuration (e2e/private-apt.sh): no root, system apt untouched.
#
# Usage: e2e/fetch-kubectl.sh            -> prints the cached binary's path (fetches if missing)
# Env:   KUBEREFIT_CACHE (default ~/.cache/kuberefit)
set -euo pipefail

K8S_VERSION=v1.20.2
DEB_VERSION="1.20.5+really1.20.2-1.1+deb12u1"
CACHE="${KUBEREFIT_CACHE:-$HOME/.cache/kuberefit}"
OUT="$CACHE/kubectl-$K8S_VERSION"
BIN="$OUT/kubectl"

if [[ -x "$BIN" ]]; then echo "$BIN"; exit 0; fi

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
log() { echo "[fetch-kubectl] $*" >&2; }
WORK="$CACHE/fetch-kubectl"
rm -rf "$WORK"; mkdir -p "$WORK"/{debs,root}
cd "$WORK"

source "$HERE/private-apt.sh"
private_apt_init "$WORK/apt"
log "apt update (private lists)"
"${APT[@]}" update >&2
log "downloading kubernetes-client=$DEB_VERSION"
(cd debs && "${APT[@]}" download "kubernetes-client=$DEB_VERSION" >&2)
dpkg-deb -x debs/kubernetes-client_*.deb root/
[[ -x root/usr/bin/kubectl ]] || { log "no usr/bin/kubectl in $(ls debs)"; exit 1; }

mkdir -p "$OUT"
cp root/usr/bin/kubectl "$BIN.tmp"
"$BIN.tmp" version --client >&2
mv "$BIN.tmp" "$BIN"
cd "$CACHE" && rm -rf "$WORK"
log "cached $BIN"
echo "$BIN"
