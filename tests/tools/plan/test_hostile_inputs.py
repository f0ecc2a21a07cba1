"""`kuberefit plan` against hostile inputs (issue 34, item 5): rates, sizes and counts outside
the documented bounds, input files too large or nested too deep, numbers too large for the
arithmetic. Every one is refused with one `Error:` line and exit 2, never a traceback, and the
JSON printed is always valid JSON (no Infinity or NaN).

The properties run the real command in-process (click's CliRunner), seeded by the "ci" profile,
with few examples each and a time bound per run."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refit_protocol.kit.config_files import json_shape_problem
from refit_tools.plan import calibration as cal
from refit_tools.plan import files, units
from refit_tools.plan.command import plan

BASE = ["--model-bytes", "1TB", "--cross-link", "10Gbit/s"]
#: Wall-clock bound of one run of the command here (the slowest, a 6 MB file, takes well under).
RUN_BOUND_S = 10.0


def run(*args: str) -> Result:
    return CliRunner().invoke(plan, list(args), catch_exceptions=False)


def _no_constants(name: str) -> Any:
    raise AssertionError(f"{name} in the JSON output")


def assert_clean(result: Result) -> None:
    """Exit 0 with valid, finite JSON, or exit 2 with one `Error:` line; never a traceback."""
    assert result.exit_code in (0, 2), (result.exit_code, result.output[-300:])
    assert "Traceback" not in result.output
    if result.exit_code == 0:
        out = json.loads(result.stdout, parse_constant=_no_constants)
        assert isinstance(out, dict)
        _assert_finite(out)
    else:
        errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1, result.stderr[-2000:]
        assert len(errors[0]) < 2000, errors[0][:200]


def _assert_finite(value: Any) -> None:
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
        elif isinstance(item, float):
            assert math.isfinite(item), item


def error_line(result: Result) -> str:
    assert result.exit_code == 2, result.output[-300:]
    [line] = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    return line


# ----------------------------------------------------------------------- regressions: rates
@pytest.mark.parametrize("option", ["--cross-link", "--intra-link"])
@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("1e-300bit/s", "at least 1 kbit/s"),
        ("999bit/s", "at least 1 kbit/s"),
        ("10.1Tbit/s", "at most 10 Tbit/s"),
        ("1e300Gbit/s", "at most 10 Tbit/s"),
    ],
)
def test_a_link_rate_outside_the_bounds_is_refused(option: str, value: str, says: str) -> None:
    """`--cross-link 1e-300bit/s` printed Infinity as JSON (and --intra-link, NaN)."""
    line = error_line(run(*BASE, option, value, "--json"))
    assert f"'{option}'" in line
    assert says in line


@pytest.mark.parametrize("option", ["--construction-rate", "--apply-rate", "--relay-hop-rate"])
@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("1e-300bit/s", "at least 1 kB/s"),
        ("999B/s", "at least 1 kB/s"),
        ("101TB/s", "at most 100 TB/s"),
    ],
)
def test_a_throughput_outside_the_bounds_is_refused(option: str, value: str, says: str) -> None:
    line = error_line(run(*BASE, option, value, "--json"))
    assert f"'{option}'" in line
    assert says in line


def test_the_bounds_themselves_give_valid_json(tmp_path: Path) -> None:
    """The extremes the bounds admit still project finite figures, and so does the plot."""
    extremes = [
        ["--model-bytes", "1PB", "--cross-link", "1kbit/s", "--intra-link", "1kbit/s"],
        ["--model-bytes", "1", "--cross-link", "10Tbit/s", "--intra-link", "10Tbit/s"],
        ["--model-bytes", "1PB", "--cross-link", "1kbit/s", "--bucket-size", "1"],
        ["--model-bytes", "1PB", "--cross-link", "1kbit/s", "--chunk-size", "1", "--nodes",
         str(units.MAX_COUNT), "--producers", str(units.MAX_COUNT), "--change-rate", "1e-9"],
        ["--model-bytes", "1PB", "--cross-link", "1kbit/s", "--apply-rate", "1kB/s",
         "--construction-rate", "1kB/s", "--relay-hop-rate", "1kB/s"],
        ["--model-bytes", "1", "--cross-link", "10Tbit/s", "--apply-rate", "100TB/s",
         "--construction-rate", "100TB/s", "--relay-hop-rate", "100TB/s"],
    ]  # fmt: skip
    for args in extremes:
        result = run(*args, "--json", "--plot", str(tmp_path / "p.svg"))
        assert result.exit_code == 0, (args, result.output[-300:])
        assert_clean(result)


@pytest.mark.parametrize(
    ("args", "option", "says"),
    [
        (["--model-bytes", "2PB"], "--model-bytes", "at most 1 PB"),
        (["--model-bytes", "9" * 400], "--model-bytes", "longer than 32 characters"),
        (["--bucket-size", "2PB"], "--bucket-size", "at most 1 PB"),
        (["--chunk-size", "1" * 40], "--chunk-size", "longer than 32 characters"),
        (["--nodes", "1" * 5000], "--nodes", "1000000"),
        (["--producers", "1000001"], "--producers", "1000000"),
        (["--change-rate", "1e-300"], "--change-rate", "at least 1e-09"),
    ],
)
def test_sizes_and_counts_outside_the_bounds_are_refused(
    args: list[str], option: str, says: str
) -> None:
    line = error_line(run(*BASE, *args, "--json"))
    assert option in line
    assert says in line


def test_the_help_says_the_bounds() -> None:
    text = " ".join(run("--help").output.split())
    for bound in ("1 kbit/s", "10 Tbit/s", "1 kB/s", "100 TB/s", "1 PB", "64MiB", "64 levels"):
        assert bound in text, bound


# ----------------------------------------------------------------------- regressions: files
def _deep(depth: int, opener: str = "[", closer: str = "]") -> str:
    return opener * depth + closer * depth


@pytest.mark.parametrize(
    "option", ["--safetensors-index", "--hf-config", "--calibration"]
)  # fmt: skip
@pytest.mark.parametrize(
    "text",
    [
        _deep(3_000_000),  # 6 MB of brackets: RecursionError before the fix
        '{"a": ' * 1_000_000 + "1" + "}" * 1_000_000,
        "[" * 100 + '"]]]]"' + "]" * 100,
        "[" * 5_000_000,  # unbalanced, 5 MB
    ],
    ids=["arrays-6MB", "objects-7MB", "strings-ignored", "unclosed-5MB"],
)
def test_a_file_nested_too_deep_is_refused(tmp_path: Path, option: str, text: str) -> None:
    path = tmp_path / "deep.json"
    path.write_text(text)
    args = ["--cross-link", "1Gbit", option, str(path)]
    if option == "--calibration":
        args += ["--model-bytes", "1TB"]
    started = time.monotonic()
    line = error_line(run(*args))
    assert time.monotonic() - started < RUN_BOUND_S
    assert f"'{option}'" in line
    assert "nested deeper than 64 levels" in line


def test_nesting_at_the_bound_is_read(tmp_path: Path) -> None:
    """64 levels are fine (the file is then judged on its content), 65 are not."""
    path = tmp_path / "index.json"
    ok = '{"metadata": {"total_size": 1000}, "x": ' + _deep(63) + "}"
    path.write_text(ok)
    assert run("--safetensors-index", str(path), "--cross-link", "1Gbit").exit_code == 0
    path.write_text('{"metadata": {"total_size": 1000}, "x": ' + _deep(64) + "}")
    assert "nested deeper" in error_line(
        run("--safetensors-index", str(path), "--cross-link", "1Gbit")
    )


@pytest.mark.parametrize("option", ["--safetensors-index", "--hf-config", "--calibration"])
def test_a_file_over_the_size_limit_is_refused_without_reading_it(
    tmp_path: Path, option: str
) -> None:
    path = tmp_path / "huge.json"
    with path.open("wb") as f:  # sparse: 64 MiB + 1 bytes on disk for free
        f.truncate(files.MAX_INPUT_FILE_BYTES + 1)
    args = ["--cross-link", "1Gbit", option, str(path)]
    if option == "--calibration":
        args += ["--model-bytes", "1TB"]
    line = error_line(run(*args))
    assert f"'{option}'" in line
    assert "larger than 64MiB" in line


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hidden_size", 10**300),
        ("vocab_size", 10**300),
        ("num_hidden_layers", 10**30),
        ("intermediate_size", 2**64),
    ],
)
def test_an_hf_config_with_impossible_sizes_is_refused(
    tmp_path: Path, field: str, value: int
) -> None:
    """hidden_size 10^300 was divided and multiplied before the overflow check: a traceback."""
    config = {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "vocab_size": 128256,
        field: value,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    line = error_line(run("--hf-config", str(path), "--cross-link", "1Gbit"))
    assert "'--hf-config'" in line
    assert field in line or "at most 1 PB" in line


def test_an_hf_config_just_over_a_petabyte_is_refused(tmp_path: Path) -> None:
    config = {
        "hidden_size": 65536,
        "num_hidden_layers": 100_000,
        "num_attention_heads": 64,
        "vocab_size": 128256,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    line = error_line(run("--hf-config", str(path), "--cross-link", "1Gbit"))
    assert "at most 1 PB" in line


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"metadata": {"total_size": Infinity}}', "total_size is inf, not a positive, finite"),
        ('{"metadata": {"total_size": NaN}}', "total_size is nan, not a positive, finite"),
        ('{"metadata": {"total_size": 1e999}}', "total_size is inf, not a positive, finite"),
        ('{"metadata": {"total_size": 2000000000000000}}', "at most 1 PB"),
        ('{"metadata": {"total_size": 1' + "0" * 1000 + "}}", "a number of 1001 characters"),
    ],
)
def test_a_safetensors_index_with_non_finite_or_huge_numbers_is_refused(
    tmp_path: Path, text: str, says: str
) -> None:
    path = tmp_path / "index.json"
    path.write_text(text)
    line = error_line(run("--safetensors-index", str(path), "--cross-link", "1Gbit"))
    assert "'--safetensors-index'" in line
    assert says in line


def test_numbers_the_plan_does_not_read_may_be_anything(tmp_path: Path) -> None:
    """Only metadata.total_size is read from an index: an Infinity elsewhere is not refused,
    and the JSON printed is still valid."""
    path = tmp_path / "index.json"
    path.write_text('{"metadata": {"total_size": 1000, "x": -Infinity}, "y": [NaN, 1e999]}')
    result = run("--safetensors-index", str(path), "--cross-link", "1Gbit", "--json")
    assert result.exit_code == 0, result.output[-300:]
    assert_clean(result)


def test_a_calibration_with_non_finite_numbers_is_refused(tmp_path: Path) -> None:
    """A calibration whose constants are Infinity (or 1e999) projected Infinity."""
    data = json.loads(cal.SHIPPED.read_text())
    data["quiet_load_per_cpu"] = float("inf")
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(data))  # writes Infinity
    line = error_line(run(*BASE, "--calibration", str(path)))
    assert "'--calibration'" in line
    assert "finite" in line


def test_json_output_never_holds_non_finite_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard: were a projection ever non-finite, the command says so (exit 2) instead of
    printing Infinity or NaN."""
    from refit_tools.plan import report

    real = report.as_json

    def broken(*args: Any) -> dict[str, Any]:
        out = real(*args)
        out["latency_s"] = float("inf")
        return out

    monkeypatch.setattr(report, "as_json", broken)
    line = error_line(run(*BASE, "--json"))
    assert "not finite" in line


def test_the_depth_scan() -> None:
    """The scan the JSON readers share: depth outside strings, unclosed brackets, a cap."""

    def deep(text: str) -> bool:
        return json_shape_problem(text, max_depth=64, max_brackets=10**6) is not None

    assert deep("[" * 65 + "]" * 65)
    assert not deep("[" * 64 + "]" * 64)
    assert not deep('["' + "[" * 100 + '"]')
    assert not deep('["\\"' + "[" * 100 + '"]')  # an escaped quote does not end the string
    assert deep("[{" * 40 + "}]" * 40)
    assert deep("[" * 65)
    assert not deep("[]" * 100_000)
    assert json_shape_problem("[]" * 11, max_depth=64, max_brackets=20) is not None
    assert not deep('["' + "[" * 100)  # a string never closed: the parser stops there
    assert not deep('["a' + '\\"[' * 100)
    started = time.monotonic()  # linear: escaped quotes are not rescanned from each one
    assert not deep('["' + '\\"' * 1_000_000)
    assert time.monotonic() - started < 3


# ------------------------------------------------------------------------------ properties
_UNITS = ["bit", "bit/s", "bps", "b", "B", "B/s", "Bps", "bytes"]
_PREFIXES = ["", "k", "K", "M", "G", "T", "P", "Ki", "Mi", "Gi", "Ti"]

numbers = st.one_of(
    st.integers(min_value=0, max_value=10**40).map(str),
    st.floats(min_value=0, allow_nan=False, allow_infinity=False).map(repr),
    st.builds(
        lambda m, e: f"{m}e{e}",
        st.integers(min_value=0, max_value=999),
        st.integers(min_value=-400, max_value=400),
    ),
    st.sampled_from(["nan", "inf", "1e-300", "1e-320", "5e-324", "1e308", "1e400", "0.0", "00"]),
    st.sampled_from([".5", "1" * 40, "1" * 5000, "9" * 33, "0" * 40 + "1"]),
)
rates = st.builds(
    lambda n, p, u, sep: f"{n}{sep}{p}{u}",
    numbers,
    st.sampled_from(_PREFIXES),
    st.sampled_from(_UNITS),
    st.sampled_from(["", " "]),
)
sizes = st.one_of(
    numbers,
    st.builds(lambda n, p: f"{n}{p}", numbers, st.sampled_from(["k", "GB", "TiB", "PB", "Mi"])),
    st.just("auto"),
)
counts = st.one_of(st.integers(min_value=-5, max_value=10**7), st.integers()).map(str)
PROPERTY = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


_RATE_OPTIONS = [
    "--cross-link",
    "--intra-link",
    "--construction-rate",
    "--apply-rate",
    "--relay-hop-rate",
]
_SIZE_OPTIONS = ["--model-bytes", "--bucket-size", "--chunk-size"]
one_input = st.one_of(
    st.tuples(st.sampled_from(_RATE_OPTIONS), rates),
    st.tuples(st.sampled_from(_SIZE_OPTIONS), sizes),
    st.tuples(st.sampled_from(["--nodes", "--producers"]), counts),
    st.tuples(st.just("--change-rate"), st.one_of(numbers, numbers.map(lambda n: n + "%"))),
)


def _run_clean(args: list[str]) -> None:
    started = time.monotonic()
    result = CliRunner().invoke(plan, args)
    assert time.monotonic() - started < RUN_BOUND_S
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        args,
        repr(result.exception),
    )
    assert_clean(result)


@PROPERTY
@given(given_input=one_input)
def test_any_one_input_gives_json_or_one_error(given_input: tuple[str, str]) -> None:
    """One hostile value among sane ones (so that it is the value that is judged)."""
    option, value = given_input
    _run_clean([*BASE, option, value, "--json"])


@PROPERTY
@given(inputs=st.lists(one_input, min_size=2, max_size=6))
def test_any_inputs_together_give_json_or_one_error(inputs: list[tuple[str, str]]) -> None:
    _run_clean([*BASE, *(part for pair in inputs for part in pair), "--json"])


@PROPERTY
@given(
    cross=st.sampled_from(["1kbit/s", "10Tbit/s"]),
    model=st.sampled_from(["1", "1PB"]),
    throughput=st.sampled_from(["1kB/s", "100TB/s"]),
    bucket=st.sampled_from(["1", "auto", "1PB"]),
    nodes=st.sampled_from(["1", str(units.MAX_COUNT)]),
    producers=st.sampled_from(["1", str(units.MAX_COUNT)]),
    change=st.sampled_from(["1e-9", "1", "3%"]),
    dtype=st.sampled_from(["1", "8"]),
)
def test_the_corners_of_the_bounds_give_finite_json(
    cross: str,
    model: str,
    throughput: str,
    bucket: str,
    nodes: str,
    producers: str,
    change: str,
    dtype: str,
) -> None:
    args = ["--model-bytes", model, "--cross-link", cross, "--intra-link", cross]
    args += ["--apply-rate", throughput, "--construction-rate", throughput]
    args += ["--bucket-size", bucket, "--chunk-size", bucket, "--nodes", nodes]
    args += ["--producers", producers, "--change-rate", change, "--dtype-bytes", dtype, "--json"]
    result = CliRunner().invoke(plan, args)
    assert result.exit_code == 0, (args, result.output[-300:])
    assert_clean(result)


json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**400),
    st.floats(),
    st.text(max_size=20),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
_SIZE_KEYS = [
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "intermediate_size",
    "num_experts",
    "moe_intermediate_size",
    "head_dim",
]
hf_configs = st.fixed_dictionaries(
    {},
    optional={
        key: st.one_of(st.integers(min_value=-5, max_value=10**400), json_scalars)
        for key in _SIZE_KEYS
    }
    | {"torch_dtype": st.sampled_from(["bfloat16", "float32", "float8_e4m3fn", "int4"])},
)
indexes = st.fixed_dictionaries(
    {"metadata": st.fixed_dictionaries({"total_size": json_scalars})}, optional={"x": json_values}
)


def _deep_text(depth: int, kinds: str) -> str:
    openers = "".join("[{"[int(k)] for k in kinds) * (depth // max(len(kinds), 1) + 1)
    openers = openers[:depth]
    closers = "".join("]}"["[{".index(o)] for o in reversed(openers))
    return "".join(o + ('"k": ' if o == "{" else "") for o in openers) + "1" + closers


documents = st.one_of(
    json_values.map(lambda v: json.dumps(v)),
    hf_configs.map(lambda v: json.dumps(v)),
    indexes.map(lambda v: json.dumps(v)),
    st.builds(
        _deep_text,
        st.integers(min_value=0, max_value=200_000),
        st.text(alphabet="01", min_size=1, max_size=4),
    ),
    st.text(max_size=200),
    st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
)


@PROPERTY
@given(
    option=st.sampled_from(["--safetensors-index", "--hf-config", "--calibration"]),
    text=documents,
)
def test_any_input_file_gives_json_or_one_error(tmp_path: Path, option: str, text: str) -> None:
    path = tmp_path / "input.json"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    args = [option, str(path), "--cross-link", "10Gbit/s", "--json"]
    if option == "--calibration":
        args += ["--model-bytes", "1TB"]
    started = time.monotonic()
    result = CliRunner().invoke(plan, args)
    assert time.monotonic() - started < RUN_BOUND_S
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        option,
        text[:200],
        repr(result.exception),
    )
    assert_clean(result)
