"""The Python versions KubeRefit claims, checked where only 3.11 runs.

The vLLM bundle and the trainer client run on the user's Python (docs/scope.md): the product
claims `requires-python >= 3.10`. Only 3.11 runs the suite, so the claim is checked statically:
vermin finds syntax and standard-library names newer than 3.10, ruff parses for 3.10 and
mypy checks against 3.10's standard library (both configured in pyproject.toml), and no product
module imports a standard-library module that 3.12 or 3.13 removed."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

from refit_sidecar.vllm.bundle import REQUIRES_PYTHON

REPO = Path(__file__).resolve().parents[1]
PACKAGES = [
    "protocol/refit_protocol",
    "operator/refit_operator",
    "sidecar/refit_sidecar",
    "tools/refit_tools",
]
#: Removed in 3.12 (PEP 632, asyncore/asynchat/smtpd/imp) and 3.13 (PEP 594).
REMOVED = frozenset(
    {"distutils", "imp", "asynchat", "asyncore", "smtpd"}
    | {"aifc", "audioop", "cgi", "cgitb", "chunk", "crypt", "imghdr", "mailcap", "msilib"}
    | {"nis", "nntplib", "ossaudiodev", "pipes", "sndhdr", "spwd", "sunau", "telnetlib", "uu"}
    | {"xdrlib", "lib2to3"}
)


def test_the_claim_is_the_same_everywhere() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["requires-python"] == ">=3.10" == REQUIRES_PYTHON
    assert project["tool"]["ruff"]["target-version"] == "py310"
    assert project["tool"]["mypy"]["python_version"] == "3.10"


def test_nothing_newer_than_python_3_10() -> None:
    vermin = Path(sys.executable).parent / "vermin"
    done = subprocess.run(
        [str(vermin), "-t=3.10-", "--no-tips", "--violations", "--eval-annotations", *PACKAGES],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_module_that_python_3_12_or_3_13_removed() -> None:
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    names = [node.module or ""]
                else:
                    continue
                found += [
                    f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] in REMOVED
                ]
    assert found == []
