"""docs/configuration.md is what the settings models say today (run `make docs` after changing
a setting), and it lists every setting of every service."""

from __future__ import annotations

from refit_tools import config_reference


def test_the_reference_in_docs_is_current() -> None:
    assert config_reference.TARGET.read_text() == config_reference.render(), (
        "docs/configuration.md is stale: run `make docs`"
    )


def test_it_names_every_setting_with_its_default() -> None:
    text = config_reference.render()
    for needle in (
        "| `node` | string | **required** |",
        "| `relay.bind` | string | **required** |",
        "| `async_staging_max_bytes` | size | `64GiB` |",
        "| `staging.inbox` | path | **required** |",
        "| `pipeline.bucket_bytes` | size or `auto` | `auto` |",
        "| `nodes[].url` | string | **required** |",
        "| `coordinator.max_attempts` | integer | `5` |",
        "| `allow_insecure` | boolean | `false` |",
    ):
        assert needle in text, needle
