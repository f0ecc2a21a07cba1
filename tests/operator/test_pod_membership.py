"""PodMembership against a real receiver service over TCP: membership follows the pods, a
replaced pod or sidecar counts as dead, joining nodes are prewarmed or restored densely, and a
restarted operator relearns a node's loader classification without asking its runtime again."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
from pydantic import SecretStr
from safetensors.torch import save_file

from refit_operator.discovery import PodView
from refit_operator.pod_membership import NoRestoreSourceError, PodMembership
from refit_protocol.commit import CommitRecord
from refit_protocol.errors import PeerAuthenticationError
from refit_protocol.receiver_api import RankPrewarm
from refit_protocol.tensors import TensorMetaModel
from refit_sidecar.bits import bits_numpy
from refit_sidecar.codec.records import TensorMeta
from refit_sidecar.receiver.appliers.inprocess import InProcessApplier
from refit_sidecar.receiver.config import ReceiverConfig
from refit_sidecar.receiver.node import ReceiverNode
from tests.sidecar.receiver.models import TinyModel, canonical, metas

TOKEN = "pod-membership-token"


class CountingInProcessApplier(InProcessApplier):
    """The in-process applier, counting how often the runtime is asked to prewarm."""

    prewarms = 0

    def prewarm(self, m: Mapping[str, TensorMeta]) -> list[RankPrewarm]:
        self.prewarms += 1
        return super().prewarm(m)


async def _node(held: int | None) -> tuple[ReceiverNode, TinyModel, CountingInProcessApplier]:
    model = TinyModel(canonical(0))
    applier = CountingInProcessApplier(model)
    cfg = ReceiverConfig(node="r0", port=0, token=SecretStr(TOKEN), held_version=held)
    node = ReceiverNode(cfg, applier)
    await node.start()
    return node, model, applier


def _pod(port: int, uid: str = "uid-1", restarts: int = 0, **kw: object) -> PodView:
    return PodView(
        namespace="ns",
        name="r0",
        uid=uid,
        role="rollout",
        policy="p",
        ip="127.0.0.1",
        phase="Running",
        control_port=port,
        restarts=restarts,
        **kw,  # type: ignore[arg-type]
    )


def _membership(
    session: aiohttp.ClientSession, pods: list[PodView], template: str = ""
) -> tuple[PodMembership, list[str]]:
    joined: list[str] = []

    async def metas_source() -> list[TensorMetaModel]:
        return metas(canonical(0))

    async def on_join(node: str, how: str) -> None:
        joined.append(f"{node}: {how}")

    m = PodMembership(
        lambda: pods,
        session,
        token=TOKEN,
        checkpoint_template=template,
        metas=metas_source,
        on_join=on_join,
    )
    return m, joined


async def test_prewarm_once_per_incarnation_and_relearned_from_the_cache(
    session: aiohttp.ClientSession,
) -> None:
    node, _, applier = await _node(held=0)
    try:
        pods = [_pod(node.port)]
        first, _ = _membership(session, pods)
        await first.prewarm_holders(0)
        await first.prewarm_holders(0)
        assert applier.prewarms == 1
        # A restarted operator: a new membership learns the classification from the node's
        # cache; the runtime (busy serving, or stopped) is not asked again.
        second, _ = _membership(session, pods)
        await second.prewarm_holders(0)
        assert applier.prewarms == 1
        assert second._prewarmed == {("r0", "uid-1", 0)}
        # Nodes that do not hold the committed version are left to `restore`.
        third, _ = _membership(session, pods)
        await third.prewarm_holders(5)
        assert third._prewarmed == set()
    finally:
        await node.close()


async def test_confirmed_dead_follows_the_pod(session: aiohttp.ClientSession) -> None:
    node, _, _ = await _node(held=0)
    try:
        pods = [_pod(node.port)]
        m, _ = _membership(session, pods)
        assert [r.node for r in await m.receivers()] == ["r0"]
        assert not await m.confirmed_dead("r0")  # answers, same incarnation
        pods[0] = _pod(node.port, restarts=1)  # the sidecar container restarted
        assert await m.confirmed_dead("r0")
        pods[0] = _pod(node.port, uid="uid-2")  # deleted and recreated under the same name
        assert await m.confirmed_dead("r0")
        pods[0] = replace(_pod(node.port), deleting=True)
        assert await m.confirmed_dead("r0")
        pods.clear()
        assert await m.confirmed_dead("r0")
        assert await m.receivers() == []
    finally:
        await node.close()


async def test_joining_node_restored_densely_or_refused_without_a_source(
    session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    node, model, _ = await _node(held=None)
    try:
        target = canonical(4)
        target["t0.weight"][2] = -0.0
        (tmp_path / "v4").mkdir()
        save_file(target, str(tmp_path / "v4" / "model.safetensors"))
        pods = [_pod(node.port)]
        bare, _ = _membership(session, pods)
        (r,) = await bare.receivers()
        with pytest.raises(NoRestoreSourceError, match="checkpointTemplate"):
            await bare.restore(r, CommitRecord(4, "g-4"))
        m, joined = _membership(session, pods, template=str(tmp_path / "v{version}"))
        (r,) = await m.receivers()
        await m.restore(r, CommitRecord(4, "g-4"))
        status = await r.status()
        assert (status.held_version, status.prewarmed) == (4, True)
        assert joined == [f"r0: restored densely to v4 from {tmp_path / 'v4'}"]
        for name, want in target.items():
            got = model.p[name.replace(".", "_")].data
            assert (bits_numpy(got) == bits_numpy(want)).all(), name
    finally:
        await node.close()


async def test_a_pod_refusing_the_token_stays_out_and_the_others_go_on(
    session: aiohttp.ClientSession,
) -> None:
    """A pod whose mounted Secret holds another token (mid-rotation, or a wrong tokenSecret):
    in a cluster only that pod stays out; the standalone coordinator's membership stops."""
    good, _, _ = await _node(held=0)
    model = TinyModel(canonical(0))
    other = ReceiverNode(
        ReceiverConfig(node="r1", port=0, token=SecretStr("another-token"), held_version=0),
        InProcessApplier(model),
    )
    await other.start()
    try:
        pods = [_pod(good.port), replace(_pod(other.port, uid="uid-9"), name="r1")]
        m, _ = _membership(session, pods)
        assert [r.node for r in await m.receivers()] == ["r0"]
        m.strict_auth = True  # what HttpMembership does for `kuberefit coordinator`
        with pytest.raises(PeerAuthenticationError, match="HTTP 401"):
            await m.receivers()
    finally:
        await good.close()
        await other.close()


async def test_a_transitions_servers_group_the_pods_injection_labelled(
    session: aiohttp.ClientSession,
) -> None:
    """A RefitTransition's `receivers.servers`: the pods of one vLLM server spanning several
    pods, by server; one-pod servers are not listed."""
    big = {"kuberefit.io/server": "big-0"}
    pods = [
        replace(_pod(1, labels=big), name="big-0"),
        replace(_pod(2, labels=big), name="big-0-1"),
        replace(_pod(3), name="small"),
    ]
    m, _ = _membership(session, pods)
    assert m.servers_of(["small", "big-0-1", "big-0"]) == {"big-0": ["big-0", "big-0-1"]}
    assert m.servers_of(["big-0", "small"]) == {}  # one pod of it took part: nothing to group
