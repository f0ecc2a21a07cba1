"""Another host of a vLLM server that spans several hosts (a LeaderWorkerSet group, or the
multiprocessing executor's `--nnodes N --headless` workers): this pod runs vLLM ranks but no
API server, so nothing here drives vLLM.

The receiver in the leader's pod applies through `collective_rpc`, which reaches every rank on
every host with the same arguments; each rank reads the payload file at the same path in its own
pod. So this applier only stages: it writes each payload's file at that path (the leader's ranks
wait for it, `RefitWorkerExtension.refit_apply`) and keeps it until the leader's receiver reports
the payload applied (`GET /v1/progress`), which bounds what this host holds like any receiver's
queue. Gate, prewarm and audit belong to the leader, which reports every rank with its host.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import urllib3

from refit_protocol.kit.auth import bearer_header
from refit_protocol.kit.config_files import ensure_directory
from refit_protocol.kit.tokens import TokenRing, as_ring
from refit_protocol.receiver_api import API_PREFIX, ApplyProgress, RankPrewarm
from refit_sidecar.codec.records import TensorMeta
from refit_sidecar.codec.wire import DecodedPayload
from refit_sidecar.receiver.appliers.base import ApplyReport, StagedPayload
from refit_sidecar.receiver.appliers.payload_files import discard_file, stage_file
from refit_sidecar.receiver.config import ApplierConfig

#: Phases in which the leader's attempt will apply nothing more.
_ENDED = frozenset({"failed", "stopped"})


class LeaderProgressError(RuntimeError):
    """The leader's receiver did not apply this host's payloads (it failed, moved on or does
    not answer): this host's part of the attempt fails with it."""


class VllmHostApplier:
    def __init__(self, config: ApplierConfig) -> None:
        self.config = config
        self.shm_dir = config.shm_dir
        ensure_directory(self.shm_dir, "applier.shm_dir")
        self.leader = config.leader_url.rstrip("/")
        self._http = urllib3.PoolManager(maxsize=2, retries=False)
        #: The leader's receiver holds the same policy token; `ReceiverNode` sets its own ring.
        self.tokens: TokenRing = as_ring(None)
        self._applied: dict[str, int] = {}  # attempt -> payloads this host saw applied

    def readiness_checks(self, timeout_s: float = 2.0) -> list[tuple[str, bool, str]]:
        """`server_leader`: the leader's receiver answers (this host's staged files are only
        ever released by it)."""
        try:
            self._progress(timeout_s)
        except LeaderProgressError as exc:
            return [("server_leader", False, str(exc))]
        return [("server_leader", True, f"server leader's receiver at {self.leader} answers")]

    def _progress(self, timeout_s: float) -> ApplyProgress:
        where = f"server leader's receiver at {self.leader}"
        try:
            resp = self._http.request(
                "GET",
                f"{self.leader}{API_PREFIX}/progress",
                headers=bearer_header(self.tokens.newest()),
                timeout=urllib3.Timeout(total=timeout_s),
            )
        except urllib3.exceptions.HTTPError as exc:
            raise LeaderProgressError(f"{where} unreachable: {exc}") from exc
        if resp.status != 200:
            raise LeaderProgressError(f"{where}: HTTP {resp.status}: {resp.data[:300]!r}")
        try:
            return ApplyProgress.model_validate(json.loads(resp.data))
        except ValueError as exc:
            raise LeaderProgressError(f"{where}: unexpected answer: {exc}") from exc

    # -- Applier -----------------------------------------------------------------------------------
    def prewarm(self, metas: Mapping[str, TensorMeta]) -> list[RankPrewarm]:
        """Nothing to classify here: the leader's prewarm reaches this host's ranks too."""
        return []

    def stage(self, decoded: DecodedPayload) -> StagedPayload:
        return stage_file(self.shm_dir, decoded)

    def apply(self, batch: Sequence[StagedPayload], check_samples: int) -> ApplyReport:
        """Wait until the leader has applied these payloads (both sides apply in the attempt's
        declared order, so counts line up), then release their files."""
        if not batch:
            return ApplyReport()
        t0 = time.perf_counter()
        attempt = batch[0].header.attempt
        target = self._applied.get(attempt, 0) + len(batch)
        deadline = time.monotonic() + self.config.stage_wait + self.config.rpc_timeout_s
        pause = 0.01
        while True:
            p = self._progress(timeout_s=5.0)
            if p.attempt == attempt and p.applied >= target:
                break
            if p.attempt == attempt and p.phase in _ENDED:
                raise LeaderProgressError(
                    f"the server leader {p.node} {p.phase} attempt {attempt} after applying "
                    f"{p.applied} payloads"
                )
            if p.attempt != attempt:
                # It was prepared before any payload flowed: it restarted or moved on.
                raise LeaderProgressError(
                    f"the server leader {p.node} is on attempt {p.attempt}, not {attempt}"
                )
            if time.monotonic() > deadline:
                raise LeaderProgressError(
                    f"the server leader {p.node} had applied {p.applied} of the {target} "
                    f"payloads of attempt {attempt} when this host stopped waiting"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.2)
        self._applied = {attempt: target}
        for staged in batch:
            self.discard(staged)
        return ApplyReport(payloads=len(batch), seconds=time.perf_counter() - t0)

    def discard(self, staged: StagedPayload) -> None:
        discard_file(staged)

    def sync(self) -> None:
        """The leader's apply synchronizes every rank's device."""

    def gate(self, closed: bool) -> None:
        """The server's request gate is the leader's API server."""

    def restore(self, source: str) -> None:
        """Nothing to load here: the leader's dense restore loads every rank, this host's too,
        from `source` in each rank's own vLLM container. This sidecar does not mount the
        checkpoint (no rollout sidecar does); the leader's restore fails if a rank cannot."""

    def audit(self, source: str) -> list[dict[str, Any]]:
        """Never reached: the node answers an audit itself (`audited_by_leader`)."""
        raise LeaderProgressError(
            "this pod is another host of a multi-host vLLM server: audit its leader's receiver, "
            "whose audit reaches every rank on every host"
        )

    def close(self) -> None:
        self._http.clear()
