# Sourced by e2e/build-images.sh and read by tests/harness/images.py: podman's settings for these
# machines, in private files (the system's containers.conf is left alone):
# - runtime runc: crun refuses this host's hybrid cgroup layout;
# - default_ulimits: root here lacks CAP_SYS_RESOURCE, so podman may not raise nofile/nproc.
PODMAN_CONF_DIR=${PODMAN_CONF_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kuberefit/podman}
mkdir -p "$PODMAN_CONF_DIR"
cat > "$PODMAN_CONF_DIR/containers.conf" <<'CONF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
export CONTAINERS_CONF="$PODMAN_CONF_DIR/containers.conf"
