"""The vLLM bundle: the code that runs inside the user's vLLM process, as a self-contained tree.

Users bring their own vLLM image, with their own Python and torch; KubeRefit is never installed
into it. What must run inside vLLM (the worker extension, the refit control path, the
storage-write hook and apply context, the compare-mode audit, prewarm, and what they import) is
copied instead, as plain source files, by an init container from the sidecar image into an
emptyDir that injection puts first on the vLLM container's `PYTHONPATH` (the OpenTelemetry
Operator's Python auto-instrumentation does the same).

The tree is the import closure of `ENTRY_MODULES` within KubeRefit's own packages, read from the
sources (every import, at module level or inside a function, except `if TYPE_CHECKING:` blocks).
Each module may import only the standard library, what vLLM itself requires (`VLLM_PROVIDES`)
and the optional packages in `OPTIONAL`, whose absence the code handles; anything else is a
`BundleError` when the bundle is built, so the test suite catches a stray `import structlog`
long before a user's vLLM would fail to start.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import shutil
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from refit_protocol import __version__
from refit_protocol.pod_contract import (
    VLLM_COMPOSED_EXTENSION,
    VLLM_MIDDLEWARE,
    VLLM_WORKER_EXTENSION,
)

#: The modules vLLM loads by name (`--worker-extension-cls`, `--middleware`).
ENTRY_MODULES: tuple[str, ...] = tuple(
    q.rpartition(".")[0] for q in (VLLM_WORKER_EXTENSION, VLLM_COMPOSED_EXTENSION, VLLM_MIDDLEWARE)
)
#: KubeRefit's own import roots; a bundle copies modules from these only.
FIRST_PARTY = frozenset({"refit_protocol", "refit_sidecar"})
#: Packages every vLLM install has (vLLM's own requirements), so the bundle may import them.
VLLM_PROVIDES = frozenset({"vllm", "torch", "numpy", "safetensors", "pydantic", "blake3"})
#: Packages the bundle uses when present and does without otherwise (the reason says how).
OPTIONAL: dict[str, str] = {
    "structlog": "refit_protocol.kit.loggers falls back to the standard library's logging",
    "numba": "refit_sidecar.compiled falls back to the numpy kernels",
}
#: Written last into an installed bundle: its version and every file's SHA-256.
MANIFEST = "kuberefit-bundle.json"
#: The Python versions the bundle's code is written for (checked by ruff's target in CI).
REQUIRES_PYTHON = ">=3.10"


class BundleError(RuntimeError):
    """The bundle cannot be built: a module is missing or imports what vLLM does not bring."""


@dataclass(frozen=True)
class BundleModule:
    """One module of the bundle: its dotted name, source file and the packages outside the
    standard library that it imports."""

    name: str
    source: Path
    third_party: frozenset[str]

    @property
    def relative(self) -> Path:
        """Where the file goes in the bundle tree."""
        parts = self.name.split(".")
        if self.source.name == "__init__.py":
            return Path(*parts, "__init__.py")
        return Path(*parts[:-1], parts[-1] + ".py")


def _source(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise BundleError(f"bundle module {name} has no Python source file")
    return Path(spec.origin)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_names(tree: ast.AST, package: str) -> Iterable[str]:
    """Every module name an import statement may load (`from a import b` may load `a.b`);
    imports under `if TYPE_CHECKING:` never run and are skipped."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)
        stack.extend(ast.iter_child_nodes(node))


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def closure(entries: Sequence[str] = ENTRY_MODULES) -> list[BundleModule]:
    """The first-party modules `entries` import, transitively, with their parent packages."""
    found: dict[str, BundleModule] = {}
    todo = list(entries)
    while todo:
        name = todo.pop()
        if name in found or name.split(".")[0] not in FIRST_PARTY:
            continue
        source = _source(name)
        package = name if source.name == "__init__.py" else name.rpartition(".")[0]
        third: set[str] = set()
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        for imported in _imported_names(ast.parse(source.read_text(), str(source)), package):
            root = imported.split(".")[0]
            if root in FIRST_PARTY:
                if _is_module(imported):
                    todo.append(imported)
            elif root and root not in sys.stdlib_module_names:
                third.add(root)
        found[name] = BundleModule(name, source, frozenset(third))
    return sorted(found.values(), key=lambda m: m.name)


def check(modules: Iterable[BundleModule]) -> None:
    """Refuse a module that imports a package vLLM does not bring (`BundleError`)."""
    allowed = VLLM_PROVIDES | set(OPTIONAL)
    bad = {m.name: sorted(m.third_party - allowed) for m in modules}
    bad = {name: pkgs for name, pkgs in bad.items() if pkgs}
    if bad:
        shown = "; ".join(f"{name} imports {', '.join(pkgs)}" for name, pkgs in sorted(bad.items()))
        raise BundleError(
            f"the vLLM bundle may import only the standard library, {sorted(VLLM_PROVIDES)} and "
            f"the optional {sorted(OPTIONAL)}: {shown}"
        )


@dataclass(frozen=True)
class Manifest:
    """What an installed bundle holds (written as `MANIFEST`)."""

    version: str
    requires_python: str
    entries: tuple[str, ...]
    files: dict[str, str]  # relative path -> SHA-256

    def to_json(self) -> dict[str, object]:
        return {
            "version": self.version,
            "requires_python": self.requires_python,
            "entries": list(self.entries),
            "files": self.files,
        }


def build(entries: Sequence[str] = ENTRY_MODULES) -> list[BundleModule]:
    """The checked closure of `entries` (see the module docstring)."""
    modules = closure(entries)
    check(modules)
    return modules


def install(dest: Path, entries: Sequence[str] = ENTRY_MODULES) -> Manifest:
    """Copy the bundle into `dest` (an init container's emptyDir), replacing an earlier copy.

    The manifest is written last, so a copy cut short (a killed init container, which the
    kubelet reruns) is never taken for a complete one."""
    modules = build(entries)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / MANIFEST).unlink(missing_ok=True)
    for root in FIRST_PARTY:
        shutil.rmtree(dest / root, ignore_errors=True)
    files: dict[str, str] = {}
    for module in modules:
        data = module.source.read_bytes()
        target = dest / module.relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        target.chmod(0o644)
        files[module.relative.as_posix()] = hashlib.sha256(data).hexdigest()
    manifest = Manifest(__version__, REQUIRES_PYTHON, tuple(entries), files)
    partial = dest / f".{MANIFEST}.partial"
    partial.write_text(json.dumps(manifest.to_json(), indent=1, sort_keys=True) + "\n")
    partial.replace(dest / MANIFEST)
    return manifest
