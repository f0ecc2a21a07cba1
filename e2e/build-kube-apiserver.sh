#!/usr/bin/env bash
# Build kube-apiserver v1.20.2 from Debian bookworm's `kubernetes` source package, offline, and cache it.
#
# No registry reachable from our machines ships a kube-apiserver binary, but Debian's source package
# carries the full upstream v1.20.2 tree with vendor/. It builds with Debian's Go 1.19 in GOPATH mode.
# Three fixes are needed (docs/development.md, "kube-apiserver"):
#   1. pkg/generated/openapi is not shipped: `make gen_openapi` (needs rsync; a cp-based stand-in works);
#   2. vendored modern-go/reflect2 1.0.1 crashes under Go >= 1.18: use Debian's 1.0.2 sources;
#   3. version ldflags must name the vendored version packages, else /version says v0.0.0.
#
# Usage: e2e/build-kube-apiserver.sh            -> prints the cached binary's path (builds if missing)
# Env:   KUBEREFIT_CACHE (default ~/.cache/kuberefit)
set -euo pipefail

K8S_VERSION=v1.20.2
DEB_VERSION="1.20.5+really1.20.2-1.1+deb12u1"
CACHE="${KUBEREFIT_CACHE:-$HOME/.cache/kuberefit}"
OUT="$CACHE/kube-apiserver-$K8S_VERSION"
BIN="$OUT/kube-apiserver"

if [[ -x "$BIN" ]]; then echo "$BIN"; exit 0; fi

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

log() { echo "[build-kube-apiserver] $*" >&2; }
WORK="$CACHE/build-kube-apiserver"
rm -rf "$WORK"; mkdir -p "$WORK"/{debs,go,bin}
cd "$WORK"

# Private apt configuration (e2e/private-apt.sh): deb + deb-src lines derived from the machine's
# configured Debian sources; the system's apt config and lists are left untouched.
source "$HERE/private-apt.sh"
private_apt_init "$WORK/apt" deb-src
log "apt update (private lists)"
"${APT[@]}" update >&2
log "fetching kubernetes=$DEB_VERSION sources, golang-1.19 and reflect2 1.0.2"
(cd debs && "${APT[@]}" source --download-only "kubernetes=$DEB_VERSION" >&2)
(cd debs && "${APT[@]}" download golang-1.19-go golang-1.19-src golang-github-modern-go-reflect2-dev >&2)

for d in debs/*.deb; do dpkg-deb -x "$d" go/; done
GOROOT="$WORK/go/usr/lib/go-1.19"
export GOROOT PATH="$GOROOT/bin:$WORK/bin:$PATH"
go version >&2

log "unpacking source"
mkdir -p gopath/src/k8s.io
tar -xf debs/kubernetes_*.orig.tar.* -C gopath/src/k8s.io
src=$(find gopath/src/k8s.io -maxdepth 1 -mindepth 1 -type d | head -1)
mv "$src" gopath/src/k8s.io/kubernetes
K="$WORK/gopath/src/k8s.io/kubernetes"

# Fix 2: reflect2 1.0.2 from Debian replaces the vendored 1.0.1.
R="$WORK/go/usr/share/gocode/src/github.com/modern-go/reflect2"
[[ -d $R ]] || { log "reflect2 sources not found in $R"; exit 1; }
rm -rf "$K/vendor/github.com/modern-go/reflect2"
cp -r "$R" "$K/vendor/github.com/modern-go/reflect2"

# Fix 1 prerequisite: rsync stand-in (drop options, cp -p the rest).
cat > bin/rsync <<'RS'
#!/usr/bin/env bash
args=(); for a in "$@"; do [[ $a == -* ]] || args+=("$a"); done
n=${#args[@]}; dst=${args[$((n-1))]}; unset "args[$((n-1))]"
mkdir -p "$dst"; for s in "${args[@]}"; do cp -rp "$s" "$dst"/; done
RS
chmod +x bin/rsync

export GOPATH="$WORK/gopath" GO111MODULE=off GOPROXY=off CGO_ENABLED=0 GOFLAGS= GOCACHE="$WORK/gocache"
cd "$K"
log "make gen_openapi"
make gen_openapi >&2
pfx=k8s.io/kubernetes/vendor/k8s.io
ld=""
for p in "$pfx/client-go/pkg/version" "$pfx/component-base/version"; do
  ld+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=20 -X $p.gitTreeState=clean"
  ld+=" -X $p.gitCommit=debian-$DEB_VERSION -X $p.buildDate=1970-01-01T00:00:00Z"
done
log "go build ./cmd/kube-apiserver (several minutes on 2 cores)"
mkdir -p "$OUT"
go build -o "$BIN.tmp" -ldflags "-s -w $ld" ./cmd/kube-apiserver
mv "$BIN.tmp" "$BIN"
cd "$CACHE" && rm -rf "$WORK"
log "built $BIN"
echo "$BIN"
