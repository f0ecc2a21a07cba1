"""Probe one policy's trainer sidecars: which producers answer, what each has staged, and
whether they agree with the policy (`probe_producers`).

The answer is a value (`ProducerProbe`): the clients in index order when every expected
producer answered and agrees, otherwise the reason, which the loop puts in the policy's Ready
condition. A producer without a baseline (a restarted sidecar) is told the committed record,
so the trainer's first export after its restart is checked against the right version.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp
import structlog

from refit_operator.discovery import Discovered
from refit_operator.pod_settings import FixedSettingsWatch
from refit_operator.policy_spec import PolicySpec
from refit_operator.producer_client import HttpProducerClient, chunking_disagreement
from refit_protocol.commit import CommitRecord
from refit_protocol.errors import EndpointError
from refit_protocol.producer_api import ProducerStatus

log = structlog.get_logger("kuberefit.policy")
#: The Ready reason while a producer's transport cannot send (e.g. credentials refused).
UNAVAILABLE = "TransportUnavailable"


@dataclass
class ProducerProbe:
    """What one probe found."""

    #: Clients of producers 0..spec.producers-1 in index order; None until all answer and agree.
    clients: list[HttpProducerClient] | None = None
    #: Why `clients` is None ("" when it is not), and the Ready condition's reason for it.
    error: str = ""
    reason: str = "ProducersNotReady"
    #: producer index -> the version it has staged (None: nothing staged).
    candidates: dict[int, int | None] = field(default_factory=dict)

    def all_staged(self, version: int) -> bool:
        """Every expected producer has staged `version` (as its status said in this probe)."""
        return self.clients is not None and all(v == version for v in self.candidates.values())


async def probe_producers(
    session: aiohttp.ClientSession,
    found: Discovered,
    spec: PolicySpec,
    token: str,
    record: CommitRecord,
    settings_watch: FixedSettingsWatch,
) -> ProducerProbe:
    """Ask every ready trainer pod's sidecar for its status (see the module docstring)."""
    probe = ProducerProbe()
    timeout = min(5.0, float(spec.control_timeout_seconds))
    clients: dict[int, HttpProducerClient] = {}
    statuses: dict[str, ProducerStatus] = {}
    for pod in found.ready_trainers:
        asking = HttpProducerClient(0, pod.url, token=token, session=session)
        try:
            status = await asyncio.wait_for(asking.status(), timeout)
        except (EndpointError, TimeoutError) as exc:
            probe.error = f"trainer pod {pod.name}: {str(exc) or f'no answer within {timeout:g}s'}"
            return probe
        settings_watch.saw(pod, status)
        if status.transport_problem:
            probe.error, probe.reason = _transport_problem(pod.name, status, spec), UNAVAILABLE
            return probe
        statuses[f"trainer pod {pod.name}"] = status
        problem = _disagreement(pod.name, status, spec, clients) or chunking_disagreement(statuses)
        if problem:
            probe.error = problem
            return probe
        client = HttpProducerClient(status.producer, pod.url, token=token, session=session)
        clients[status.producer] = client
        probe.candidates[status.producer] = status.candidate_version
        held = CommitRecord(status.committed_version, status.committed_baseline)
        if not status.baseline_ready and held != record:
            try:
                await asyncio.wait_for(client.learn_committed(record), timeout)
            except (EndpointError, TimeoutError) as exc:
                probe.error = f"trainer pod {pod.name} refused v{record.version}: {exc}"
                return probe
            log.info("producer.told_committed", pod=pod.name, version=record.version)
    if sorted(clients) != list(range(spec.producers)):
        probe.error = (
            f"trainer sidecars report producer indices {sorted(clients)}; spec.producers "
            f"is {spec.producers}, so indices 0..{spec.producers - 1} are expected"
        )
        return probe
    probe.clients = [clients[i] for i in range(spec.producers)]
    return probe


def _transport_problem(pod: str, status: ProducerStatus, spec: PolicySpec) -> str:
    """The producer's own words, and where its credentials and CA come from (the user's fix)."""
    text = f"trainer pod {pod} cannot send: {status.transport_problem}"
    if spec.transport != "s3" or spec.s3 is None:
        return text
    s3 = spec.s3
    keys = (
        f"Secret {s3.credentials_secret} (keys AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY; read "
        "when the pod started: recreate it after a change)"
        if s3.credentials_secret
        else "the pod's own identity (spec.s3.credentialsSecret is not set)"
    )
    ca = s3.ca_bundle
    trust = (
        "the sidecar image's trust store (spec.s3.caBundle is not set)"
        if ca is None
        else f"{'Secret' if ca.secret else 'ConfigMap'} {ca.secret or ca.config_map} key {ca.key}"
    )
    return f"{text}; credentials: {keys}; CA: {trust}"


def _disagreement(
    pod: str, status: ProducerStatus, spec: PolicySpec, clients: dict[int, HttpProducerClient]
) -> str | None:
    """Why one trainer sidecar's answer cannot be used with this policy's others, if it cannot."""
    if status.producers is not None and status.producers != spec.producers:
        return (
            f"trainer pod {pod} splits the checkpoint among {status.producers} "
            f"producers, spec.producers is {spec.producers}: recreate the trainer pods "
            "(injection writes the policy's count into their sidecars)"
        )
    if status.producer in clients:
        return (
            f"trainer pod {pod} reports producer index {status.producer}, "
            "which another trainer pod reports too"
        )
    return None
