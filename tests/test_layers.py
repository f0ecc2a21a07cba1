"""The house's one-way layering, read from every import in the product's source (lazy ones in
functions included) — docs/architecture.md draws the same arrows.

    refit_tools ──▶ refit_operator ──▶ refit_protocol ◀── refit_sidecar ◀── refit_tools

The protocol imports neither side; the control plane never imports the data plane (nor torch,
vllm or zmq: the operator image has none of them); the data plane never imports the control
plane; no product package imports the tools or the tests; and no two files import each other,
directly or around a circle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {
    "refit_protocol": REPO / "protocol" / "refit_protocol",
    "refit_operator": REPO / "operator" / "refit_operator",
    "refit_sidecar": REPO / "sidecar" / "refit_sidecar",
    "refit_tools": REPO / "tools" / "refit_tools",
}
HEAVY = {"torch", "vllm", "zmq", "numpy", "numba"}
#: What each package must never import (top-level module names).
FORBIDDEN = {
    "refit_protocol": {"refit_operator", "refit_sidecar", "refit_tools", "tests", "e2e"} | HEAVY,
    "refit_operator": {"refit_sidecar", "refit_tools", "tests", "e2e"} | HEAVY,
    "refit_sidecar": {"refit_operator", "refit_tools", "tests", "e2e"},
    "refit_tools": {"tests", "e2e"},
}
#: The e2e/ scripts sit on the top floor beside the tools: the device check runs where only
#: torch and the data plane's source are carried (`e2e/device/`), the mutation run drives
#: pytest from outside; neither may lean on the control plane, the tools or the tests.
E2E = REPO / "e2e"
E2E_FORBIDDEN = {"refit_operator", "refit_tools", "tests"}


def module_name(package: str, path: Path) -> str:
    rel = path.relative_to(PACKAGES[package]).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([package, *parts])


def product_modules() -> dict[str, Path]:
    return {
        module_name(pkg, f): f for pkg, root in PACKAGES.items() for f in sorted(root.rglob("*.py"))
    }


def imports(path: Path, module: str) -> Iterator[tuple[int, str]]:
    """(line, imported module) for every import statement anywhere in the file, with relative
    imports resolved; `from X import y` yields X and X.y (y may be a submodule)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def test_every_package_exists() -> None:
    for root in PACKAGES.values():
        assert (root / "__init__.py").is_file(), root


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_imports_flow_one_way(package: str) -> None:
    bad = []
    for f in sorted(PACKAGES[package].rglob("*.py")):
        for line, name in imports(f, module_name(package, f)):
            if name.split(".")[0] in FORBIDDEN[package]:
                bad.append(f"{f.relative_to(REPO)}:{line} imports {name}")
    assert not bad, "\n".join(sorted(set(bad)))


def test_wire_models_never_import_the_process_kit() -> None:
    """`refit_protocol` is the wire models (messages, commit record, tensor identities, sizes,
    errors, the pod contract) and, in `refit_protocol.kit`, what runs a process (command,
    settings files, tokens, logs, metrics, HTTP skeleton): the kit may use the models, never
    the other way round."""
    root = PACKAGES["refit_protocol"]
    wire = sorted(root.glob("*.py"))
    assert {f.stem for f in wire} >= {"commit", "producer_api", "receiver_api", "tensors", "sizes"}
    bad = [
        f"{f.relative_to(REPO)}:{line} imports {name}"
        for f in wire
        for line, name in imports(f, module_name("refit_protocol", f))
        if name.startswith("refit_protocol.kit")
    ]
    assert not bad, "\n".join(sorted(set(bad)))
    kit_face = root / "kit" / "__init__.py"
    assert list(imports(kit_face, "refit_protocol.kit")) == [], "the kit's face imports nothing"


def test_e2e_scripts_import_only_the_data_plane() -> None:
    scripts = sorted(E2E.rglob("*.py"))
    assert scripts, E2E
    bad = [
        f"{f.relative_to(REPO)}:{line} imports {name}"
        for f in scripts
        for line, name in imports(f, f.stem)
        if name.split(".")[0] in E2E_FORBIDDEN
    ]
    assert not bad, "\n".join(sorted(set(bad)))


def arrows(path: Path, module: str, modules: set[str]) -> set[str]:
    """The product modules this file imports. `from pkg import sub` is an arrow to the module
    `pkg.sub`, not to `pkg/__init__.py`: Python runs a package's __init__ whatever is imported
    from it, so a package that re-exports its modules is not a circle."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in modules else base)
    return (out & modules) - {module}


def test_no_import_cycles_between_files() -> None:
    modules = product_modules()
    graph = {mod: arrows(path, mod, set(modules)) for mod, path in modules.items()}
    cycles = _strongly_connected(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(sorted(c)) for c in cycles)


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm (iterative); components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = set()
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.add(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        out.append(comp)
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def test_cycle_finder_finds_a_cycle() -> None:
    """The checker itself: a two-file circle and a three-file circle are reported."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert sorted(sorted(c) for c in _strongly_connected(graph)) == [["a", "b"], ["c", "d", "e"]]


def test_scanner_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    """An import inside a function and a relative import are both seen."""
    f = tmp_path / "mod.py"
    f.write_text("def f():\n    import refit_sidecar.codec\n    from .x import y\n")
    names = {n for _, n in imports(f, "refit_operator.mod")}
    assert {"refit_sidecar.codec", "refit_operator.x", "refit_operator.x.y"} <= names


def test_control_plane_imports_no_heavy_modules_at_run_time() -> None:
    """Importing every control-plane and protocol module, and `kuberefit --help`, load none of
    torch, vllm or zmq (the static scan above cannot see imports made by third parties)."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import refit_operator, refit_protocol\n"
        "for pkg in (refit_protocol, refit_operator):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(m.name)\n"
        "from click.testing import CliRunner\n"
        "from refit_protocol.kit.cli import build\n"
        "r = CliRunner().invoke(build(), ['--help'])\n"
        "assert r.exit_code == 0, r.output\n"
        "print(sorted(n for n in ('torch', 'vllm', 'zmq') if n in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
