#!/usr/bin/env bash
# `make images`: the operator and sidecar images, built for real with Debian's podman, from a base
# image made here with debootstrap (no container registry is reachable from these machines).
#
#   localhost/kuberefit-base:bookworm      Debian bookworm minbase + python3, python3-venv
#   localhost/kuberefit-operator:dev       Dockerfile.operator
#   localhost/kuberefit-sidecar:dev        Dockerfile.sidecar
#
# The builds run with --network none: pip installs from a wheelhouse made here (build/wheels,
# `pip wheel` of the project with its extras; torch from the machine's CPU wheel), mounted into
# the build. Elsewhere the Dockerfiles build as they are, from PyPI (docs/operator.md, "Images").
# Installs podman, buildah, runc and debootstrap with apt-get when they are missing (root).
# Prints each image's size; tests/test_images.py runs them. `--base-only` makes only the base.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source e2e/podman-env.sh

log() { echo "[build-images] $*" >&2; }
BASE=localhost/kuberefit-base:bookworm
WHEELS=build/wheels
PYTHON=${PYTHON:-.venv/bin/python}

if ! command -v podman >/dev/null || ! command -v debootstrap >/dev/null; then
  log "installing podman, buildah, runc, uidmap and debootstrap (Debian packages)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman buildah runc uidmap debootstrap >/dev/null
fi

# -- the base: Debian bookworm from the machine's own Debian mirror ------------------------------
if ! podman image exists "$BASE"; then
  mirror=$(grep -hoE '^URIs: *\S*debian/?$' /etc/apt/sources.list.d/*.sources 2>/dev/null \
    | head -1 | awk '{print $2}')
  [[ -n $mirror ]] || mirror=$(grep -hoE '^deb +\S*debian/? ' /etc/apt/sources.list 2>/dev/null \
    | head -1 | awk '{print $2}')
  [[ -n $mirror ]] || { log "no Debian mirror in the apt sources"; exit 1; }
  rootfs=$(mktemp -d)
  trap 'rm -rf "$rootfs"' EXIT
  log "debootstrap bookworm from $mirror"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$rootfs" "$mirror" >/dev/null
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | podman import - "$BASE" >/dev/null
  rm -rf "$rootfs"
  trap - EXIT
fi

# `--base-only`: stop here (`make images-base`, which needs no venv, so it runs beside the venv
# installs; `make images` then finds the base).
[[ ${1:-} == --base-only ]] && exit 0

# -- the wheelhouse: everything both images install, nothing fetched during the builds -----------
mkdir -p "$WHEELS"
log "wheelhouse $WHEELS"
# The project is built in the tree (egg-info, build/): one build at a time (`make setup` runs
# this beside the venv installs, which build it too).
flock build/.project-build.lock \
  "$PYTHON" -m pip wheel -q --disable-pip-version-check --progress-bar off -w "$WHEELS" \
  '.[operator,sidecar]' 'setuptools>=77' wheel

build() {  # build NAME DOCKERFILE
  log "building localhost/kuberefit-$1:dev"
  podman build -q --network none --volume "$PWD/$WHEELS:/wheels:ro" \
    --build-arg BASE="$BASE" --build-arg PIP_INSTALL_FLAGS="--no-index --find-links /wheels" \
    -f "$2" -t "localhost/kuberefit-$1:dev" . >/dev/null
}
build operator Dockerfile.operator
build sidecar Dockerfile.sidecar
podman image prune -f >/dev/null  # the layers of earlier builds under these tags
for name in operator sidecar; do
  size=$(podman image inspect --format '{{.Size}}' "localhost/kuberefit-$name:dev")
  echo "localhost/kuberefit-$name:dev $((size / 1024 / 1024)) MiB"
done
