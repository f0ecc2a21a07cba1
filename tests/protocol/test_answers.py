"""An older client reads a newer peer's answer: the fields it does not know, at any depth, are
dropped; what it knows is validated as strictly as ever."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from refit_protocol.kit.answers import read_answer
from refit_protocol.producer_api import ProducerStatus


def _newer_status(**extra: object) -> bytes:
    status = ProducerStatus(
        producer=1,
        committed_version=4,
        committed_baseline="g-4",
        settings={"zstd_level": 3, "shuffle": False, "bucket_bytes": "auto"},  # type: ignore[arg-type]
        fixed={"chunk_bytes": "auto", "baseline_storage": "file"},  # type: ignore[arg-type]
    ).model_dump(mode="json")
    status["added_in_a_later_release"] = {"anything": [1, 2]}
    status["settings"]["a_later_codec_knob"] = 7
    status["fixed"]["a_later_fixed_setting"] = "x"
    return json.dumps(status | extra).encode()


def test_fields_a_newer_sidecar_adds_are_ignored_at_every_depth() -> None:
    raw = _newer_status()
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        ProducerStatus.model_validate_json(raw)  # what a strict read would do
    status = read_answer(ProducerStatus, raw)
    assert (status.producer, status.committed_version) == (1, 4)
    assert status.settings is not None
    assert status.settings.zstd_level == 3
    assert status.fixed is not None
    assert status.fixed.baseline_storage == "file"


def test_known_fields_are_still_validated() -> None:
    with pytest.raises(ValidationError, match="committed_version"):
        read_answer(ProducerStatus, _newer_status(committed_version="four"))
    with pytest.raises(ValidationError, match="producer"):
        read_answer(ProducerStatus, json.dumps({"committed_version": 1}))


def test_what_is_not_json_is_refused_as_before() -> None:
    with pytest.raises(ValidationError, match="Invalid JSON"):
        read_answer(ProducerStatus, b"<html>502 Bad Gateway</html>")


def test_shapes_beyond_todays_answers_are_filtered_by_position_and_name() -> None:
    class Inner(BaseModel):
        model_config = ConfigDict(extra="forbid")
        x: int

    class Outer(BaseModel):
        model_config = ConfigDict(extra="forbid")
        pair: tuple[Inner, dict[str, int]]
        many: list[Inner] | None = None
        named: int = Field(0, validation_alias="vee")

    raw = json.dumps(
        {
            "pair": [{"x": 1, "new": 2}, {"y": 6}],
            "many": [{"x": 3, "new": 4}],
            "vee": 3,
            "new": True,
        }
    )
    got = read_answer(Outer, raw)
    assert got.pair == (Inner(x=1), {"y": 6})  # the dict is not filtered by Inner's fields
    assert got.many == [Inner(x=3)]
    assert got.named == 3
