"""`make mutation`: mutmut over the modules that carry the invariants, against their fast tests.

Not part of `make test` (it takes minutes per module). Each group below is mutated in its own
scratch copy of the packages and tests (mutmut wants the packages at the top of its working
directory; the repository keeps them one level down), with only the group's modules mutated
(`only_mutate`) and only the group's test files run. The report gives per module: mutants,
killed, survived, without a covering test, and the score killed / (killed + survived + no
tests + timeouts). Survivors are listed in `<out>/<group>.survivors.txt`; `mutmut show NAME`
in `<out>/<group>/` shows one.

    python e2e/mutation.py [--only GROUP ...] [--out DIR] [--jobs N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {
    "refit_protocol": REPO / "protocol" / "refit_protocol",
    "refit_sidecar": REPO / "sidecar" / "refit_sidecar",
    "refit_operator": REPO / "operator" / "refit_operator",
    "refit_tools": REPO / "tools" / "refit_tools",
}
#: group -> (modules mutated, test files run against them)
GROUPS: dict[str, tuple[list[str], list[str]]] = {
    "codec-locations": (
        ["refit_sidecar/codec/locations.py"],
        [
            "tests/sidecar/codec/test_locations.py",
            "tests/sidecar/codec/test_roundtrip.py",
            "tests/sidecar/codec/test_wire.py",
        ],
    ),
    "codec-wire": (
        ["refit_sidecar/codec/wire.py"],
        [
            "tests/sidecar/codec/test_wire.py",
            "tests/sidecar/codec/test_limits.py",
            "tests/sidecar/codec/test_mac.py",
        ],
    ),
    "apply-hook": (
        ["refit_sidecar/apply/hook.py"],
        [
            "tests/sidecar/apply/test_hook.py",
            "tests/sidecar/apply/test_context.py",
            "tests/sidecar/apply/test_hook_paths.py",
            "tests/sidecar/apply/test_placeholders.py",
            "tests/sidecar/apply/test_audit.py",
        ],
    ),
    "commit-rules": (
        ["refit_operator/commit_store/rules.py"],
        ["tests/operator/test_commit_rules.py", "tests/operator/test_sqlite_store.py"],
    ),
    "receiver-dedup": (
        ["refit_sidecar/receiver/admission.py", "refit_sidecar/receiver/state.py"],
        [
            "tests/sidecar/receiver/test_admission.py",
            "tests/sidecar/receiver/test_state.py",
            "tests/sidecar/receiver/test_core.py",
        ],
    ),
}


#: mutmut stops a mutant after (the tests' estimated time + CONSTANT) x MULTIPLIER seconds of
#: wall time (twice that of CPU time).
TIMEOUT_MULTIPLIER = 2.0
TIMEOUT_CONSTANT = 4.0


def scratch_copy(root: Path) -> None:
    """The packages at the top of `root`, with the tests and the pytest settings."""
    for name, path in PACKAGES.items():
        shutil.copytree(path, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "tests", root / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")


def write_config(root: Path, modules: list[str], tests: list[str]) -> None:
    lines = ["[mutmut]", "source_paths="]
    lines += [f"    {name}/" for name in PACKAGES]
    lines += ["only_mutate="] + [f"    {m}" for m in modules]
    # A mutant that makes a loop run forever is stopped after (estimate + constant) x this
    # seconds of wall time; mutmut's defaults (1 s, x15) spent ~30 s of a 2-core machine on
    # each one, and a smaller constant stopped mutants still importing and compiling numba.
    lines += [f"timeout_multiplier={TIMEOUT_MULTIPLIER}", f"timeout_constant={TIMEOUT_CONSTANT}"]
    # Children forked from mutmut's own process (the default) inherit a process that already
    # ran the tests, with numba's and torch's threads started: a child that compiles a kernel
    # could hang until the timeout. A fork server that only imported the tests has no threads.
    lines += ["process_isolation=forkserver", "forkserver_warmup=collect"]
    lines += ["pytest_add_cli_args_test_selection="] + [f"    {t}" for t in tests]
    (root / "setup.cfg").write_text("\n".join(lines) + "\n")


def mutmut(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).parent / "mutmut"
    env = os.environ | {"KUBEREFIT_MUTATION": "1"}  # tests/conftest.py: a fixed example set
    # One torch/OpenMP thread per child: the children already fill the cores, and OpenMP's
    # spinning threads on a busy machine burn the CPU-time limit (SIGXCPU) of mutants that
    # would finish in seconds.
    env |= {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.run(
        [str(exe), *args], cwd=root, env=env, capture_output=True, text=True, check=False
    )


def run_group(name: str, out: Path, jobs: int) -> dict[str, object]:
    modules, tests = GROUPS[name]
    root = out / name
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    scratch_copy(root)
    write_config(root, modules, tests)
    start = time.monotonic()
    run = mutmut(root, "run", "--max-children", str(jobs))
    elapsed = time.monotonic() - start
    mutmut(root, "export-cicd-stats")
    stats_file = root / "mutants" / "mutmut-cicd-stats.json"
    if not stats_file.is_file():
        tail = (run.stdout + run.stderr)[-3000:]
        raise SystemExit(f"{name}: mutmut produced no results (exit {run.returncode}):\n{tail}")
    stats = json.loads(stats_file.read_text())
    results = mutmut(root, "results").stdout
    (out / f"{name}.survivors.txt").write_text(results)
    counted = sum(stats[k] for k in ("killed", "survived", "no_tests", "timeout", "suspicious"))
    score = stats["killed"] / counted if counted else 0.0
    row: dict[str, object] = {"group": name, "modules": modules, "seconds": round(elapsed, 1)}
    return row | {"score": score} | stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=sorted(GROUPS), help="Only GROUP.")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(tempfile.gettempdir()) / "kuberefit-mutation",
        help="Where the scratch copies, survivors and report.json go.",
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="mutmut children.")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.only or list(GROUPS):
        print(f"mutating {name} ...", flush=True)
        row = run_group(name, args.out, args.jobs)
        rows.append(row)
        print(
            f"  {row['score']:.0%} killed ({row['killed']} of {row['total']}; "
            f"survived {row['survived']}, no test {row['no_tests']}, "
            f"timeout {row['timeout']}) in {row['seconds']} s",
            flush=True,
        )
    (args.out / "report.json").write_text(json.dumps(rows, indent=2))
    print(f"\n{'group':<18}{'mutants':>8}{'killed':>8}{'survived':>10}{'no test':>9}{'score':>8}")
    for r in rows:
        print(
            f"{r['group']:<18}{r['total']:>8}{r['killed']:>8}{r['survived']:>10}"
            f"{r['no_tests']:>9}{r['score']:>8.0%}"
        )
    print(f"\nsurvivors: {args.out}/<group>.survivors.txt; report: {args.out}/report.json")


if __name__ == "__main__":
    main()
