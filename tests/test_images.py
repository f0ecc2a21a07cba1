"""The operator and sidecar images, built by `make images` (e2e/build-images.sh, Debian's podman)
and run here with podman, each as its non-root user on a read-only root file system:

- the operator image serves `kuberefit operator serve` against the harness API server until its
  `/readyz` answers 200;
- the sidecar image copies the vLLM bundle into a volume exactly as the injected init container
  does (the same command), and the copy is the code of this checkout;
- the sidecar image runs a receiver (`kuberefit receiver serve`, settings in $KUBEREFIT_CONFIG
  as injection writes them) that answers `/healthz`.

The images' sizes are printed (docs/operator.md, "Images")."""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from refit_sidecar.vllm.bundle import MANIFEST, build
from refit_tools.local.procs import free_ports, http_ok
from tests.harness.kube import KubeCluster
from tests.harness.operator_env import wait_for

REPO = Path(__file__).resolve().parents[1]
OPERATOR, SIDECAR = "localhost/kuberefit-operator:dev", "localhost/kuberefit-sidecar:dev"
#: How the chart runs both: non-root, read-only root file system (podman mounts a tmpfs /tmp).
LOCKED_DOWN = ["--read-only", "--user", "65532:65532", "--cap-drop", "ALL"]

pytestmark = pytest.mark.timeout(600)


@functools.cache
def _podman_env() -> dict[str, str]:
    """podman's settings for these machines (e2e/podman-env.sh), read once."""
    conf = subprocess.run(
        ["bash", "-c", "source e2e/podman-env.sh && echo $CONTAINERS_CONF"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return {**os.environ, "CONTAINERS_CONF": conf}


def podman(*args: str, check: bool = True, timeout: float = 300) -> str:
    done = subprocess.run(
        ["podman", *args], env=_podman_env(), capture_output=True, text=True, timeout=timeout
    )
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {done.returncode}:\n{done.stderr}")
    return done.stdout


@pytest.fixture(scope="module")
def images() -> dict[str, int]:
    """Both images exist (built by `make images`); their sizes in bytes."""
    sizes = {}
    for image in (OPERATOR, SIDECAR):
        exists = subprocess.run(
            ["podman", "image", "exists", image], env=_podman_env(), check=False
        ).returncode
        if exists != 0:
            pytest.fail(f"image {image} missing: `make images` builds it (e2e/build-images.sh)")
        sizes[image] = int(podman("image", "inspect", "--format", "{{.Size}}", image))
    return sizes


@pytest.fixture
def container() -> Iterator[list[str]]:
    """Names of detached containers to remove after the test."""
    names: list[str] = []
    yield names
    for name in names:
        podman("rm", "-f", "-t", "2", name, check=False)


def _logs(name: str) -> str:
    return podman("logs", name, check=False)[-3000:]


def _answers(url: str) -> bool:
    """GET `url` answers 200 (False while nothing listens or it answers otherwise)."""
    try:
        return http_ok(url)
    except OSError:
        return False


def _wait_for_url(what: str, url: str, name: str) -> None:
    try:
        wait_for(what, lambda: _answers(url), timeout=120)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; podman logs {name}:\n{_logs(name)}") from None


def test_image_sizes(images: dict[str, int]) -> None:
    for image, size in images.items():
        print(f"{image}: {size / 2**20:.0f} MiB")
    assert images[OPERATOR] < images[SIDECAR]  # no torch, no numba in the operator's


def _in_image(image: str, *argv: str) -> str:
    return podman(
        "run", "--rm", "--network", "none", *LOCKED_DOWN, "--entrypoint", argv[0], image, *argv[1:]
    )


def test_operator_image_holds_the_control_plane_only(images: dict[str, int]) -> None:
    probe = (
        "import importlib, importlib.util as u, pkgutil, refit_operator, refit_protocol\n"
        "n = 0\n"
        "for pkg in (refit_protocol, refit_operator):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(m.name); n += 1\n"
        "heavy = ('torch', 'vllm', 'zmq', 'numpy', 'refit_sidecar', 'refit_tools')\n"
        "print(n, sorted(h for h in heavy if u.find_spec(h) is not None))\n"
    )
    count, heavy = _in_image(OPERATOR, "python", "-c", probe).split(" ", 1)
    assert int(count) >= 10  # every control-plane module imports
    assert heavy.strip() == "[]"
    listing = _in_image(OPERATOR, "kuberefit", "--help").split("Commands:", 1)[1]
    commands = {line.split()[0] for line in listing.splitlines() if line.strip()}
    assert {"coordinator", "operator", "verify"} <= commands  # verify: the control plane's too
    assert not {"demo", "bench", "receiver", "producer", "vllm-bundle"} & commands


def test_operator_image_serves_against_the_api_server(
    images: dict[str, int], refit_crds: KubeCluster, tmp_path: Path, container: list[str]
) -> None:
    namespace = f"img-{secrets.token_hex(3)}"
    refit_crds.kubectl("create", "namespace", namespace)
    kubeconfig = tmp_path / "kubeconfig"
    ca = base64.b64encode(refit_crds.ca_path.read_bytes()).decode()
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "c",
                        "cluster": {
                            "server": refit_crds.server,
                            "certificate-authority-data": ca,
                        },
                    }
                ],
                "users": [{"name": "u", "user": {"token": refit_crds.token}}],
                "contexts": [{"name": "u", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "u",
            }
        )
    )
    kubeconfig.chmod(0o644)  # read by the image's user, 65532
    (port,) = free_ports(1)
    name = f"kuberefit-operator-{secrets.token_hex(3)}"
    container.append(name)
    podman(
        *("run", "-d", "--name", name, "--network", "host", *LOCKED_DOWN),
        *("-v", f"{kubeconfig}:/etc/kuberefit/kubeconfig:ro"),
        *("-e", "KUBECONFIG=/etc/kuberefit/kubeconfig"),
        OPERATOR,
        *("operator", "serve", "--namespace", namespace, "--identity", "image"),
        *("--metrics-bind", f"127.0.0.1:{port}", "--lease-seconds", "5", "--poll-seconds", "0.5"),
    )
    _wait_for_url("the operator image's /readyz", f"http://127.0.0.1:{port}/readyz", name)
    running = json.loads(podman("inspect", name))[0]
    assert running["State"]["Running"], _logs(name)
    assert running["HostConfig"]["ReadonlyRootfs"] is True
    assert running["Config"]["User"] == "65532:65532"


def test_sidecar_image_copies_the_vllm_bundle_as_the_init_container_does(
    images: dict[str, int], tmp_path: Path
) -> None:
    volume = tmp_path / "bundle"
    volume.mkdir()
    volume.chmod(0o777)  # an emptyDir is writable by every user
    out = podman(
        *("run", "--rm", "--network", "none", *LOCKED_DOWN),
        *("-v", f"{volume}:/kuberefit/vllm-bundle"),
        SIDECAR,
        *("vllm-bundle", "install", "/kuberefit/vllm-bundle"),  # the injected command
    )
    assert "vLLM bundle of" in out
    manifest = json.loads((volume / MANIFEST).read_text())
    here = {
        m.relative.as_posix(): hashlib.sha256(m.source.read_bytes()).hexdigest() for m in build()
    }
    assert manifest["files"] == here  # the image carries this checkout's code


def test_receiver_from_the_sidecar_image_answers_healthz(
    images: dict[str, int], container: list[str]
) -> None:
    http, relay = free_ports(2)
    config = {
        "node": "image-rollout-0",
        "host": "127.0.0.1",
        "port": http,
        "relay": {"bind": f"tcp://127.0.0.1:{relay}"},
        "applier": {"kind": "vllm", "vllm_url": "http://127.0.0.1:1", "shm_dir": "/tmp/shm"},
    }
    name = f"kuberefit-receiver-{secrets.token_hex(3)}"
    container.append(name)
    podman(
        *("run", "-d", "--name", name, "--network", "host", *LOCKED_DOWN),
        *("-e", f"KUBEREFIT_CONFIG={json.dumps(config)}"),
        *("-e", f"KUBEREFIT_TOKEN={secrets.token_hex(16)}"),
        SIDECAR,
        *("receiver", "serve"),
    )
    _wait_for_url("the receiver image's /healthz", f"http://127.0.0.1:{http}/healthz", name)
    # Not ready: no vLLM behind it, and /readyz says so.
    assert not _answers(f"http://127.0.0.1:{http}/readyz"), _logs(name)
