"""A container's own view of the file system, for the harness kubelet's isolated pods.

Run as `ip netns exec NS unshare --mount --uts --propagation private PYTHON pod_sandbox.py SPEC
-- COMMAND...`: in the new mount namespace it bind-mounts each volume at its mountPath (the
pod's /dev/shm and /etc/hosts first), sets the pod's hostname, then execs COMMAND, so the
container sees the same paths it would see in a pod and nothing is rewritten. Every source is
opened before the first mount, so a mount over a parent (`/tmp`, `/dev/shm`) never hides a
source. A missing mount point is created (on the host: empty directories such as
/var/lib/kuberefit; a kubelet creates them in the container's root file system).

SPEC (JSON): {"hostname": str, "mounts": [[source, mountPath, read_only], ...]} in mount order.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys
from pathlib import Path

MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC = 0x1, 0x20, 0x1000, 0x4000
_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str, target: str, flags: int) -> None:
    if _libc.mount(source.encode(), target.encode(), None, flags, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def main(argv: list[str]) -> None:
    spec_path, separator, *command = argv
    if separator != "--" or not command:
        raise SystemExit("usage: pod_sandbox.py SPEC -- COMMAND...")
    spec = json.loads(Path(spec_path).read_text())
    opened = [(os.open(src, os.O_PATH), dst, ro) for src, dst, ro in spec["mounts"]]
    for fd, target, read_only in opened:
        source = f"/proc/self/fd/{fd}"
        if os.path.isdir(source):
            os.makedirs(target, exist_ok=True)
        elif not os.path.exists(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            Path(target).touch()
        _mount(source, target, MS_BIND | MS_REC)
        if read_only:
            _mount("none", target, MS_BIND | MS_REMOUNT | MS_RDONLY)
        os.close(fd)
    socket.sethostname(spec["hostname"])
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
