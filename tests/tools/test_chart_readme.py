"""charts/kuberefit/README.md is what values.yaml and values.schema.json say today (run
`make docs` after changing a value), it leaves nothing of values.yaml out, and a value without a
`# --` comment cannot be rendered at all."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from refit_tools import chart_readme


def test_the_chart_readme_is_current() -> None:
    assert chart_readme.TARGET.read_text() == chart_readme.render(), (
        "charts/kuberefit/README.md is stale: run `make docs`"
    )


def _at(values: dict[str, Any], path: str) -> Any:
    for key in path.split("."):
        values = values[key]
    return values


def _scalars(values: Any, prefix: str = "") -> list[str]:
    """Dotted paths of everything in values.yaml that is not a non-empty mapping."""
    if isinstance(values, dict) and values:
        return [p for k, v in values.items() for p in _scalars(v, f"{prefix}{k}.")]
    return [prefix.removesuffix(".")]


def test_every_value_has_a_row_with_its_default_and_a_description() -> None:
    values = yaml.safe_load((chart_readme.CHART / "values.yaml").read_text())
    rows = {r.key: r for r in chart_readme.rows()}
    for row in rows.values():
        assert row.description.strip(), f"{row.key}: empty description"
        if not row.section:
            assert json.loads(row.default.strip("`")) == _at(values, row.key), row.key
    for path in _scalars(values):
        # Its own row, or a row of a Kubernetes object above it that shows it whole.
        parts = path.split(".")
        shown = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
        row = next((rows[p] for p in shown if p in rows), None)
        assert row is not None, f"{path} has no row"
        assert not row.section, f"{path} has no row"
    text = chart_readme.render()
    for needle in (
        '| `image.pullPolicy` | `Always` \\| `IfNotPresent` \\| `Never` | `"IfNotPresent"` |',
        "| `operator.replicas` | integer | ",
        '| `operator.resources` | object | `{"requests":',
        '| `sidecar.shmSizeLimit` | string or integer | `"8Gi"` |',
        "| `webhook.enabled` | boolean | `true` |",
        "| `networkPolicies.openPorts` | list | ",
        "| `sidecar.ports` | section | (section) |",
        "helm install kuberefit charts/kuberefit -n kuberefit-system --create-namespace\n",
    ):
        assert needle in text, needle


@pytest.mark.parametrize(
    ("after", "comment"),
    [
        (None, ""),  # a new top-level value, appended
        ("webhook:", ""),  # a new value of a section, first under its heading
        ("webhook:", "  # a note, not a helm-docs description\n"),
    ],
    ids=["top-level", "in-a-section", "plain-comment"],
)
def test_an_undocumented_value_is_refused(tmp_path: Path, after: str | None, comment: str) -> None:
    chart = tmp_path / "kuberefit"
    shutil.copytree(chart_readme.CHART, chart)
    values = chart / "values.yaml"
    schema = json.loads((chart / "values.schema.json").read_text())
    if after is None:
        values.write_text(values.read_text() + "\nnewKnob: 3\n")
        schema["properties"]["newKnob"] = {"type": "integer"}
        key = "newKnob"
    else:
        lines = values.read_text().splitlines(keepends=True)
        at = lines.index(f"{after}\n") + 1
        values.write_text("".join([*lines[:at], comment, "  newKnob: 3\n", *lines[at:]]))
        schema["properties"][after.rstrip(":")]["properties"]["newKnob"] = {"type": "integer"}
        key = f"{after.rstrip(':')}.newKnob"
    (chart / "values.schema.json").write_text(json.dumps(schema))
    with pytest.raises(ValueError, match=rf"`{key}` has no `# -- ` comment"):
        chart_readme.render(chart)

    # Documented, it renders.
    indent = "" if after is None else "  "
    documented = f"{indent}# -- A knob.\n{indent}newKnob: 3"
    values.write_text(values.read_text().replace(f"{indent}newKnob: 3", documented))
    assert f"| `{key}` | integer | `3` | A knob. |" in chart_readme.render(chart)
