"""The worker extension composed from a user's (verl, OpenRLHF) and KubeRefit's."""

from __future__ import annotations

import pytest

from refit_sidecar.vllm.composed import CompositionError, compose
from refit_sidecar.vllm.worker_extension import RefitWorkerExtension


class UserExtension:
    """Stands in for an RL framework's extension: one method of its own."""

    def update_weights_from_ipc(self) -> str:
        return "theirs"


class ClashingExtension:
    def refit_apply(self) -> None:
        """Would shadow KubeRefit's."""


def test_both_classes_methods_in_one() -> None:
    cls = compose(f"{__name__}.UserExtension")
    assert cls.__mro__[1:3] == (UserExtension, RefitWorkerExtension)
    assert cls().update_weights_from_ipc() == "theirs"
    for method in ("refit_prewarm", "refit_apply", "refit_audit", "refit_fingerprint"):
        assert getattr(cls, method) is getattr(RefitWorkerExtension, method)
    assert compose("") is RefitWorkerExtension


@pytest.mark.parametrize(
    ("qualname", "says"),
    [
        (f"{__name__}.ClashingExtension", "already defines refit_apply"),
        ("no_such_module.Ext", "cannot import"),
        (f"{__name__}.UserExtension.update_weights_from_ipc", "cannot import"),
        ("pytest.approx", "is not a class"),
    ],
)
def test_what_cannot_be_composed_is_refused(qualname: str, says: str) -> None:
    with pytest.raises(CompositionError, match=says):
        compose(qualname)
