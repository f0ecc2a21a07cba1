"""Prometheus conventions every KubeRefit process follows, and the checker the tests apply.

- Names start with `kuberefit_`; units are in the name, in base units: `_seconds`, `_bytes`
  (`_timestamp_seconds` for Unix times); counters end `_total`; nothing else does.
- No `_created` series: importing this module turns them off for the whole process
  (`prometheus_client.disable_created_metrics`), so a counter is one series, not two.
- Labelled series are created with their known label values at start (`preset`), so a rate or
  an alert sees 0 before the first event instead of no series at all.
- Every process exports `kuberefit_build_info{component, version} 1` (`add_build_info`).

`convention_problems` reads the text of a `/metrics` answer and lists every breach of these
rules (tests/protocol/test_metrics_conventions.py scrapes each service with it).
"""

from __future__ import annotations

import platform
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import prometheus_client
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.metrics import MetricWrapperBase

from refit_protocol import __version__

prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

PREFIX = "kuberefit_"
BUILD_INFO = "kuberefit_build_info"
#: Buckets of the refit latency and stage histograms (seconds): 1 ms .. 1 h.
SECONDS_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
    600,
    1800,
    3600,
)
#: Buckets of a fraction in [0, 1] (changed elements / elements).
FRACTION_BUCKETS = (0.0001, 0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def add_build_info(registry: CollectorRegistry | None, component: str) -> Gauge:
    """`kuberefit_build_info{component, version, python} 1` on `registry` (None: the global)."""
    gauge = Gauge(
        BUILD_INFO,
        "Always 1; the labels say which KubeRefit component and version this process runs.",
        ["component", "version", "python"],
        registry=prometheus_client.REGISTRY if registry is None else registry,
    )
    gauge.labels(component, __version__, platform.python_version()).set(1)
    return gauge


def preset(metric: MetricWrapperBase, *label_sets: Sequence[str] | str) -> None:
    """Create the children of `metric` for every known label value (tuple per child for
    several labels), so each series exists at 0 before its first event."""
    for values in label_sets:
        metric.labels(*((values,) if isinstance(values, str) else values))


# -- the checker ----------------------------------------------------------------------------------
@dataclass
class Family:
    """One `# TYPE` block of an exposition: its name, type and sample names."""

    name: str
    type: str
    samples: list[str] = field(default_factory=list)
    labels: list[dict[str, str]] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_SUFFIXES = {
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count", ""),
    "counter": ("",),
    "gauge": ("",),
    "untyped": ("",),
    "info": ("",),
}


def parse_exposition(text: str) -> dict[str, Family]:
    """The families of a Prometheus text exposition (format 0.0.4), by `# TYPE` name."""
    families: dict[str, Family] = {}
    current: Family | None = None
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(None, 3)
            current = families[name] = Family(name, kind.strip())
            continue
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        sample, labels, value = m.group(1), m.group(3) or "", m.group(4)
        family = current if current is not None and sample.startswith(current.name) else None
        if family is None:  # a sample without its TYPE line
            family = families.setdefault(sample, Family(sample, "untyped"))
        family.samples.append(sample)
        family.labels.append(dict(_LABEL.findall(labels)))
        try:
            family.values.append(float(value))
        except ValueError:
            family.values.append(float("nan"))
    return families


def _unit_problem(f: Family) -> str | None:
    """The unit rule this family's name breaks, if any."""
    base = f.name[: -len("_total")] if f.type == "counter" else f.name
    words = set(base.split("_"))
    if words & {"ms", "milliseconds", "msec", "us", "microseconds", "minutes", "hours"}:
        return "use base units (seconds)"
    if words & {"kb", "kib", "mb", "mib", "gb", "gib"}:
        return "use base units (bytes)"
    if "timestamp" in words and not base.endswith("_timestamp_seconds"):
        return "a Unix time ends `_timestamp_seconds`"
    if words & {"latency", "duration", "seconds", "time", "elapsed"} and not base.endswith(
        "_seconds"
    ):
        return "a duration ends `_seconds` (`_seconds_total` for a counter)"
    if "bytes" in words and not base.endswith("_bytes"):
        return "a size ends `_bytes` (`_bytes_total` for a counter)"
    return None


def convention_problems(
    text: str,
    *,
    required: Iterable[str] = (),
    component: str | None = None,
    may_be_empty: Iterable[str] = (),
) -> list[str]:
    """Every way a `/metrics` answer breaks the conventions above (empty: none).

    Checks the `kuberefit_` families only (a client library's own process and platform
    families are left alone): no `_created` series; counters end `_total` and nothing else
    does; units in the names; every family has a sample (its labelled series pre-created),
    except those in `may_be_empty` (labels only known at run time, e.g. a policy's name);
    `kuberefit_build_info` is there with value 1 (and `component` when given); and each
    name in `required` is a family (its `# TYPE` name, e.g. `kuberefit_x_total`)."""
    families = parse_exposition(text)
    problems: list[str] = []
    empty_ok = set(may_be_empty)
    for f in families.values():
        created = [s for s in f.samples if s.endswith("_created")]
        if created:
            problems.append(f"{f.name}: `_created` series {sorted(set(created))}")
        if not f.name.startswith(PREFIX):
            continue
        if f.type == "counter" and not f.name.endswith("_total"):
            problems.append(f"{f.name}: a counter's name ends `_total`")
        if f.type != "counter" and f.name.endswith("_total"):
            problems.append(f"{f.name}: only counters end `_total` (this is a {f.type})")
        unit = _unit_problem(f)
        if unit is not None:
            problems.append(f"{f.name}: {unit}")
        if not f.samples and f.name not in empty_ok:
            problems.append(f"{f.name}: no series (create its labelled series at start)")
        suffixes = _SUFFIXES.get(f.type, ("",))
        stray = [s for s in f.samples if s not in {f.name + x for x in suffixes}]
        if stray and f.type != "untyped":
            problems.append(f"{f.name}: unexpected series {sorted(set(stray))}")
    info = families.get(BUILD_INFO)
    if info is None or not info.samples:
        problems.append(f"{BUILD_INFO}: missing")
    else:
        if any(v != 1 for v in info.values):
            problems.append(f"{BUILD_INFO}: value is not 1")
        if not all(lab.get("version") for lab in info.labels):
            problems.append(f"{BUILD_INFO}: no version label")
        if component is not None and component not in {lab.get("component") for lab in info.labels}:
            problems.append(f"{BUILD_INFO}: no component={component!r}")
    for name in required:
        if name not in families:
            problems.append(f"{name}: missing")
    return problems


def registry_problems(registry: CollectorRegistry, **kwargs: object) -> list[str]:
    """`convention_problems` of what `registry` would answer on /metrics."""
    text = prometheus_client.generate_latest(registry).decode()
    return convention_problems(text, **kwargs)  # type: ignore[arg-type]
