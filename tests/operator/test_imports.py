"""The operator image ships without torch, vllm and zmq: importing the control plane must not
pull them in."""

from __future__ import annotations

import subprocess
import sys

FORBIDDEN = ("torch", "vllm", "zmq")


def test_refit_operator_imports_no_heavy_modules() -> None:
    code = (
        "import pkgutil, importlib, sys, refit_operator\n"
        "for m in pkgutil.walk_packages(refit_operator.__path__, 'refit_operator.'):\n"
        "    importlib.import_module(m.name)\n"
        f"print(sorted(n for n in {FORBIDDEN!r} if n in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_cli_help_works_without_heavy_modules() -> None:
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from refit_operator.cli import main\n"
        "r = CliRunner().invoke(main, ['--help'])\n"
        "assert r.exit_code == 0 and 'demo' in r.output, r.output\n"
        f"print(sorted(n for n in {FORBIDDEN!r} if n in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
