"""The producer control-plane messages carry a plan unchanged across the wire."""

from __future__ import annotations

import json

from refit_protocol.producer_api import AttemptPlan


def test_attempt_plan_round_trips_through_json() -> None:
    plan = AttemptPlan(
        attempt="a-2",
        from_version=3,
        target_version=4,
        baseline_id="b-3",
        mode="overwrite",
        xor_incompatible=frozenset({"model.embed_tokens.weight"}),
        receivers=("node-0", "node-1"),
        relay_tree=("tcp://10.0.0.1:5555", "tcp://10.0.0.2:5555"),
    )
    wire = plan.model_dump_json()
    assert AttemptPlan.model_validate_json(wire) == plan
    # The set of names travels sorted: the same plan always has the same bytes.
    names = {"b.weight", "a.weight", "c.bias"}
    other = plan.model_copy(update={"xor_incompatible": frozenset(names)})
    assert json.loads(other.model_dump_json())["xor_incompatible"] == sorted(names)
