"""What the Dockerfiles build, checked without Docker (no engine on these machines).

Both images are parsed: what they COPY must exist and be tracked by git (else `docker build`
fails, or ships a file that exists only here), their ENTRYPOINT and pip extras must exist in
pyproject.toml, and they must not run as root. The commands other parts of the project run in
them must exist too: the sidecar commands injection puts into pods, the operator command and
flags the chart's Deployment passes, and the vLLM worker extension and middleware classes
injection appends to the vLLM container (found by AST, without importing torch or vLLM)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from refit_protocol import pod_contract
from refit_protocol.kit.cli import build

REPO = Path(__file__).resolve().parents[1]
DOCKERFILES = ["Dockerfile.operator", "Dockerfile.sidecar"]
INSTRUCTIONS = {"FROM", "ARG", "ENV", "WORKDIR", "COPY", "RUN", "USER", "ENTRYPOINT", "CMD"}
PYPROJECT: dict[str, Any] = tomllib.loads((REPO / "pyproject.toml").read_text())


def _parse(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction; continuations joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in (REPO / name).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending += line
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        word, _, args = pending.partition(" ")
        assert word.upper() in INSTRUCTIONS, f"{name}: unexpected instruction {pending!r}"
        out.append((word.upper(), args.strip()))
        pending = ""
    assert not pending, f"{name} ends inside a continuation"
    return out


def _args(name: str, instruction: str) -> list[str]:
    return [args for word, args in _parse(name) if word == instruction]


def _copied(name: str) -> list[str]:
    return [src for args in _args(name, "COPY") for src in args.split()[:-1]]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_copy_sources_exist_and_are_tracked(name: str) -> None:
    for src in _copied(name):
        assert (REPO / src).exists(), f"{name} copies missing {src}"
        done = subprocess.run(
            ["git", "ls-files", "--error-unmatch", src], cwd=REPO, capture_output=True, text=True
        )
        assert done.returncode == 0, f"{name} copies {src}, which git does not track"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_entrypoint_is_a_project_script(name: str) -> None:
    [entrypoint] = _args(name, "ENTRYPOINT")
    exe, *_ = json.loads(entrypoint)  # exec form: a JSON list, so signals reach kuberefit
    module, _, function = PYPROJECT["project"]["scripts"][exe].partition(":")
    assert callable(getattr(importlib.import_module(module), function))


@pytest.mark.parametrize("name", DOCKERFILES)
def test_installed_extras_exist(name: str) -> None:
    extras = [e for run in _args(name, "RUN") for e in re.findall(r"'\.\[([^\]]+)\]'", run)]
    assert extras, f"{name} installs no '.[extra]'"
    known = PYPROJECT["project"]["optional-dependencies"]
    for extra in ",".join(extras).split(","):
        assert extra.strip() in known, f"{name} installs unknown extra {extra!r}"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_runs_as_non_root(name: str) -> None:
    [user] = _args(name, "USER")
    uid, _, gid = user.partition(":")
    assert uid not in {"0", "root"}, user
    assert gid not in {"0", "root"}, user


def test_sidecar_image_ships_the_data_plane_only() -> None:
    roots = {src.split("/")[0] for src in _copied("Dockerfile.sidecar")}
    assert {"sidecar", "protocol", "pyproject.toml", "README.md"} <= roots
    assert not {"operator", "tools"} & roots


def test_sidecar_build_args_are_declared_and_used() -> None:
    args = dict(a.partition("=")[::2] for a in _args("Dockerfile.sidecar", "ARG"))
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert "VLLM_SPEC" not in args  # vLLM is the user's image; the bundle goes into it
    assert "PIP_EXTRA_INDEX_URL" not in args
    [install] = [r for r in _args("Dockerfile.sidecar", "RUN") if "pip install" in r]
    assert '--extra-index-url "${TORCH_INDEX_URL}"' in install
    assert "vllm" not in install.replace("vllm-bundle", "")
    assert "import refit_sidecar.cli, refit_protocol.pod_contract" in install
    assert "kuberefit vllm-bundle list" in install  # the bundle builds from the installed code
    order = [w if w != "ARG" else a.partition("=")[0] for w, a in _parse("Dockerfile.sidecar")]
    assert order.index("TORCH_INDEX_URL") < order.index("RUN")  # an ARG is unset before it


def _invoke(*argv: str) -> str:
    result = CliRunner().invoke(build(), list(argv))
    assert result.exit_code == 0, f"kuberefit {' '.join(argv)}: {result.output}"
    return result.output


def _injected_commands() -> list[list[str]]:
    patch = (REPO / "operator/refit_operator/injection/patch.py").read_text()
    return [json.loads(m) for m in re.findall(r'command = (\["kuberefit"[^\]]*\])', patch)]


def test_injection_runs_the_sidecar_commands() -> None:
    commands = _injected_commands()
    assert sorted(c[1:] for c in commands) == [["producer", "serve"], ["receiver", "serve"]]
    patch = (REPO / "operator/refit_operator/injection/patch.py").read_text()
    assert '"command": ["kuberefit", "vllm-bundle", "install", ' in patch  # the init container
    assert "DEST" in _invoke("vllm-bundle", "install", "--help")
    assert pod_contract.CONFIG_ENV == "KUBEREFIT_CONFIG"
    for command in commands:
        assert "KUBEREFIT_CONFIG" in _invoke(*command[1:], "--help")


def test_chart_deployment_runs_existing_operator_flags() -> None:
    deployment = (REPO / "charts/kuberefit/templates/deployment.yaml").read_text()
    command = re.search(r"command: (\[.*\])", deployment)
    assert command is not None
    assert json.loads(command.group(1)) == ["kuberefit", "operator", "serve"]
    help_text = _invoke("operator", "serve", "--help")
    flags = set(re.findall(r"- --([a-z-]+)=", deployment))
    required = {"webhook-bind", "webhook-cert-dir", "injection-config", "metrics-bind"}
    required |= {"metrics-token-file", "lease-seconds", "poll-seconds", "namespace"}
    assert required <= flags
    for flag in flags:
        assert f"--{flag} " in help_text, f"deployment.yaml passes --{flag}, unknown to operator"


@pytest.mark.parametrize(
    "qualname", [pod_contract.VLLM_WORKER_EXTENSION, pod_contract.VLLM_MIDDLEWARE]
)
def test_vllm_qualnames_are_classes(qualname: str) -> None:
    module, _, name = qualname.rpartition(".")
    spec = importlib.util.find_spec(module)  # imports the parent packages only
    assert spec is not None, f"no module {module}"
    assert spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    assert name in classes, f"{module} defines no class {name}"
