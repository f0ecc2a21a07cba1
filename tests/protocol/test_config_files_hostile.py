"""Settings files against hostile input (issue 34, item 6): `<component> config --check` (and
every service's --config, which reads files the same way) refuses a file too large, nested too
deep, with too many values, with a number too long or not finite, or with a size string too long,
in one line and exit 2: never a traceback, and in bounded time. YAML is parsed by libyaml.

The properties run the real command in-process (click's CliRunner), seeded by the "ci" profile,
with few examples each and a time bound per run."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refit_protocol.kit import cli, config_files
from refit_protocol.kit.config_files import MAX_CONFIG_BYTES, ConfigFileError, load_config
from refit_protocol.sizes import parse_byte_size
from refit_sidecar.receiver.config import ReceiverConfig

PREFIX = "kuberefit receiver config: error: "
#: Wall-clock bound of one `config --check` here (the slowest, 1 MiB of YAML, takes ~1 s).
RUN_BOUND_S = 10.0


def check(text: str | bytes, tmp_path: Path, name: str = "r.yaml") -> tuple[int, str, str]:
    path = tmp_path / name
    if isinstance(text, str):
        path.write_text(text)
    else:
        path.write_bytes(text)
    started = time.monotonic()
    result = CliRunner().invoke(
        cli.build(), ["receiver", "config", "--check", str(path)], prog_name="kuberefit"
    )
    elapsed = time.monotonic() - started
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert elapsed < RUN_BOUND_S, elapsed
    return result.exit_code, result.stdout, result.stderr


def refused(text: str | bytes, tmp_path: Path, name: str = "r.yaml") -> str:
    """The one line of a refused file (exit 2)."""
    code, out, err = check(text, tmp_path, name)
    assert code == 2, (code, out[-300:], err[-300:])
    lines = err.splitlines()
    assert len(lines) == 1, err[-2000:]
    assert lines[0].startswith(PREFIX), lines[0][:300]
    assert len(lines[0]) < 1000, lines[0][:300]
    return lines[0]


# --------------------------------------------------------------------------------- regressions
@pytest.mark.parametrize(
    ("text", "name"),
    [
        ('{"node": "n", "x": ' + "[" * 200_000 + "]" * 200_000 + "}", "r.json"),
        ('{"node": "n", "x": ' + '{"a": ' * 100_000 + "1" + "}" * 100_000 + "}", "r.json"),
        ("node: n\nx: " + "[" * 200_000 + "]" * 200_000 + "\n", "r.yaml"),
        ("node: n\nx: " + "[" * 500_000 + "\n", "r.yaml"),
        ("node: n\nx: " + "{a: " * 100_000 + "1" + "}" * 100_000 + "\n", "r.yaml"),
        ("node: n\nx:\n" + "".join(" " * d + "a:\n" for d in range(1, 1000)), "r.yaml"),
        ("node: n\nx:\n" + "".join(" " * d + "a:\n" for d in range(1, 100)), "r.yaml"),
        ("node: n\nx:\n" + "".join(" " * d + "- \n" for d in range(1, 100)), "r.yaml"),
    ],
    ids=[
        "json-arrays",
        "json-objects",
        "yaml-flow-arrays",
        "yaml-flow-unclosed",
        "yaml-flow-mappings",
        "yaml-block-1000",
        "yaml-block-100",
        "yaml-block-lists",
    ],
)
def test_deep_nesting_is_one_line(text: str, name: str, tmp_path: Path) -> None:
    """Deep JSON or YAML nesting raised RecursionError: a traceback and exit 1."""
    line = refused(text, tmp_path, name)
    assert "nested deeper than 64 levels" in line or "exceeded maximum nesting depth" in line


def test_a_string_that_never_closes_is_scanned_once(tmp_path: Path) -> None:
    """Escaped quotes with no closing one: the depth scan must not restart at each of them
    (quadratic: minutes for a few hundred kilobytes)."""
    started = time.monotonic()
    line = refused('{"node": "' + '\\"' * 400_000, tmp_path, "r.json")
    assert time.monotonic() - started < 3
    assert "not valid JSON" in line


def test_nesting_up_to_the_bound_is_read(tmp_path: Path) -> None:
    """64 levels (the document's own mapping is the first) pass to the settings' validation."""
    text = '{"node": "n", "x": ' + "[" * 63 + "]" * 63 + "}"
    line = refused(text, tmp_path, "r.json")
    assert "x: Extra inputs are not permitted" in line
    text = '{"node": "n", "x": ' + "[" * 64 + "]" * 64 + "}"
    assert "nested deeper than 64 levels" in refused(text, tmp_path, "r.json")


@pytest.mark.parametrize("digits", [1_000_001, 999_990, 33])
def test_a_long_size_is_refused_before_any_arithmetic(digits: int, tmp_path: Path) -> None:
    """1,000,001 digits with KiB raised decimal.Overflow (a traceback); 999,990 took ~42 s."""
    started = time.monotonic()
    line = refused(f"node: n\nasync_staging_max_bytes: {'1' * digits}KiB\n", tmp_path)
    assert time.monotonic() - started < 5
    assert "async_staging_max_bytes" in line
    assert f"a size of {digits + 3} characters is longer than 32 characters" in line


def test_a_large_yaml_file_is_refused_unread(tmp_path: Path) -> None:
    """10 MB of YAML with unknown keys took over 30 s and 1.7 GB (pure-Python YAML)."""
    text = "node: n\n" + "".join(f"unknown_{i}: value_{i}\n" for i in range(450_000))
    assert len(text) > 10_000_000
    started = time.monotonic()
    line = refused(text, tmp_path)
    assert time.monotonic() - started < 2
    assert "larger than 1MiB" in line


def test_a_file_just_under_the_limit_is_parsed_in_bounded_time(tmp_path: Path) -> None:
    """1 MiB of unknown keys, parsed by libyaml: refused for its values in about a second."""
    lines, size, i = ["node: n"], 8, 0
    while size < MAX_CONFIG_BYTES - 40:
        lines.append(f"k{i}: v{i}")
        size += len(lines[-1]) + 1
        i += 1
    line = refused("\n".join(lines) + "\n", tmp_path)
    assert "more than 100,000 values" in line


def test_yaml_is_parsed_by_libyaml() -> None:
    assert yaml.__with_libyaml__, "PyYAML without libyaml: pip install the binary wheel"
    assert issubclass(config_files.YAML_LOADER, yaml.CSafeLoader)


def test_an_endless_device_is_refused_unread() -> None:
    """--check /dev/zero read forever (read_text); now at most 1 MiB + 1 byte is read."""
    result = CliRunner().invoke(
        cli.build(), ["receiver", "config", "--check", "/dev/zero"], prog_name="kuberefit"
    )
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [f"{PREFIX}/dev/zero: larger than 1MiB"]


def test_yaml_aliases_expanding_past_the_bound_are_refused(tmp_path: Path) -> None:
    lines = ["node: n", "a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    line = refused("\n".join(lines) + "\n", tmp_path)
    assert "more than 100,000 values" in line


@pytest.mark.parametrize(
    ("text", "name", "says"),
    [
        ("node: n\nmanifest_wait_s: .inf\n", "r.yaml", ".inf is not a finite number at line 2"),
        ("node: n\nmanifest_wait_s: .nan\n", "r.yaml", ".nan is not a finite number"),
        ("node: n\nmanifest_wait_s: 1.0e+999\n", "r.yaml", "1.0e+999 is not a finite number"),
        ('{"node": "n", "manifest_wait_s": Infinity}', "r.json", "Infinity is not a finite"),
        ('{"node": "n", "manifest_wait_s": NaN}', "r.json", "NaN is not a finite number"),
        ('{"node": "n", "manifest_wait_s": 1e999}', "r.json", "1e999 is not a finite number"),
        ("node: n\nport: " + "1" * 5000 + "\n", "r.yaml", "a number of 5000 characters"),
        ('{"node": "n", "port": ' + "1" * 5000 + "}", "r.json", "a number of 5000 characters"),
        (b"node: \xff\xfe\n", "r.yaml", "not UTF-8 text"),
    ],
)
def test_numbers_too_long_or_not_finite_and_non_text_are_refused(
    text: str | bytes, name: str, says: str, tmp_path: Path
) -> None:
    assert says in refused(text, tmp_path, name)


def test_a_huge_unknown_key_is_named_shortened(tmp_path: Path) -> None:
    text = '{"node": "n", "relay": {"bind": "tcp://127.0.0.1:1", "' + "k" * 500_000 + '": 1}}'
    line = refused(text, tmp_path, "r.json")
    assert line.endswith(f"relay.{'k' * 57}...: Extra inputs are not permitted"), line[-200:]


def test_the_environment_text_is_bounded() -> None:
    with pytest.raises(ConfigFileError, match="larger than 1MiB"):
        load_config(ReceiverConfig, text="node: n\n" + "#" * MAX_CONFIG_BYTES)


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("1" * 33, "a size of 33 characters is longer than 32 characters"),
        (" " * 40 + "1KiB", "longer than 32 characters"),
        ("9223372036854775808", "less than 8EiB"),
        ("8192PiB", "less than 8EiB"),
        (2**63, "less than 8EiB"),
        (1e300, "less than 8EiB"),
        ("1.0000000000000000000000000001", "not a whole number of bytes"),
    ],
)
def test_sizes_are_bounded(value: str | int | float, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_byte_size(value)


def test_sizes_at_the_bounds_are_exact() -> None:
    assert parse_byte_size("9223372036854775807") == 2**63 - 1
    assert parse_byte_size("8191PiB") == 8191 * 2**50
    assert parse_byte_size("1.5TiB") == 3 * 2**39


# ---------------------------------------------------------------------------------- properties
PROPERTY = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
_FIELDS = sorted(ReceiverConfig.model_fields)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),
    st.text(max_size=20),
    st.integers(min_value=0, max_value=10**40).map(lambda n: f"{n}KiB"),
    st.sampled_from(["64Mi", "1.5GB", "auto", "1" * 40 + "KiB", "9" * 200, ".inf", "1e999"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(
            st.one_of(st.sampled_from(_FIELDS), st.text(max_size=8)), inner, max_size=4
        ),
    ),
    max_leaves=25,
)
documents = st.dictionaries(
    st.one_of(st.sampled_from(_FIELDS), st.text(max_size=10)), values, max_size=6
).map(lambda d: {"node": "n", **d})


def _deep(depth: int, style: str) -> str:
    if style == "json":
        return '{"node": "n", "x": ' + "[" * depth + "]" * depth + "}"
    if style == "flow":
        return "node: n\nx: " + "[" * depth + "]" * depth + "\n"
    return "node: n\nx:\n" + "".join(" " * d + "a:\n" for d in range(1, min(depth, 1300)))


texts = st.one_of(
    documents.map(lambda d: (json.dumps(d), "r.json")),
    documents.map(lambda d: (yaml.safe_dump(d), "r.yaml")),
    st.builds(
        lambda depth, style: (_deep(depth, style), "r.json" if style == "json" else "r.yaml"),
        st.integers(min_value=0, max_value=300_000),
        st.sampled_from(["json", "flow", "block"]),
    ),
    st.builds(
        lambda n, unit: (f"node: n\nasync_staging_max_bytes: {'7' * n}{unit}\n", "r.yaml"),
        st.integers(min_value=1, max_value=1_000_050),
        st.sampled_from(["", "KiB", "GB", "Pi"]),
    ),
    st.text(max_size=300).map(lambda t: (t, "r.yaml")),
    st.text(max_size=300).map(lambda t: ("{" + t, "r.json")),
)


@PROPERTY
@given(case=texts)
def test_any_settings_file_is_valid_or_one_line(case: tuple[str, str], tmp_path: Path) -> None:
    text, name = case
    code, out, err = check(text.encode("utf-8", "surrogatepass"), tmp_path, name)
    assert code in (0, 2), (code, out[-300:], err[-300:])
    if code == 0:
        assert out.strip().endswith("valid ReceiverConfig")
    else:
        lines = err.splitlines()
        assert len(lines) == 1, err[-2000:]
        assert lines[0].startswith(PREFIX), lines[0][:300]


@pytest.mark.parametrize("value", ['"inf"', "1e999", '"NaN"', "-.inf"])
def test_a_setting_is_never_infinite_or_nan(value: str, tmp_path: Path) -> None:
    """pydantic takes "inf" (and YAML 1.1's `1e999`, a string) for a float: an infinite
    timeout would wait forever. The loader refuses any non-finite value, naming the setting."""
    line = refused(f"node: n\nflush_timeout_s: {value}\n", tmp_path)
    assert "flush_timeout_s" in line or "line 2" in line, line  # YAML's .inf: at parse time
