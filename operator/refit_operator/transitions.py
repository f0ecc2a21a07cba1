"""RefitTransition objects: the coordinator's progress as users see it in kubectl.

`TransitionRecorder` is the coordinator's `ProgressSink` for one transition: it creates (or,
after a takeover, continues) the RefitTransition, merge-patches its `/status` on every phase
change or new message and at most once per `min_interval_s` otherwise, aggregates the
receivers' staged and applied payload counts while the attempt streams, and posts an Event for
every phase change, retry, takeover, restore and the outcome. The rendering is pure
(`progress_status`, `outcome_status`) so it is tested without a cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from collections.abc import Awaitable, Callable, Mapping

import structlog

from refit_operator.kube.api import (
    ConflictError,
    KubeApi,
    NotFoundError,
    Obj,
    object_ref,
    owner_reference,
)
from refit_operator.kube.names import API_VERSION, POLICY
from refit_operator.ports import TransitionProgress
from refit_operator.transition_types import TransitionResult

log = structlog.get_logger("kuberefit.transitions")

TERMINAL = frozenset({"Committed", "Rejected", "Conflict", "Aborted", "Failed"})
OUTCOME_PHASE = {
    "committed": "Committed",
    "rejected": "Rejected",
    "conflict": "Conflict",
    "aborted": "Aborted",
    "failed": "Failed",
}
#: Polls the attempt's receivers: {"staged": n, "applied": n, "nodes": n} summed over them.
ProgressPoll = Callable[[], Awaitable[Mapping[str, int]]]


def transition_name(policy: str, to_version: int, retry: int = 0) -> str:
    """`<policy>-v000005` (names sort in version order); `-2`, `-3` for later tries."""
    base = f"{policy}-v{to_version:06d}"
    return f"{base}-{retry + 1}" if retry else base


def try_number(obj: Obj) -> int:
    """0 for `<policy>-v000005`, 1 for `…-2`, 2 for `…-3` (the inverse of `transition_name`)."""
    _, _, suffix = str(obj["metadata"]["name"]).rpartition("-")
    return int(suffix) - 1 if suffix.isdigit() else 0


def _order(obj: Obj) -> tuple[int, int]:
    return int(obj["spec"]["toVersion"]), try_number(obj)


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_seconds(s: float) -> str:
    return f"{s * 1000:.0f}ms" if s < 1 else f"{s:.2f}s" if s < 60 else f"{s / 60:.1f}m"


def progress_status(p: TransitionProgress) -> Obj:
    """The status fields a progress update sets."""
    out: Obj = {
        "phase": p.phase,
        "attempt": p.attempt,
        "attemptId": p.attempt_id or None,
        "mode": p.mode,
        "message": p.message or None,
    }
    if p.payloads or p.wire_bytes:
        out.update(
            payloads=p.payloads,
            wireBytes=p.wire_bytes,
            wireBytesHuman=human_bytes(p.wire_bytes),
        )
    if p.total_elements:
        out.update(
            changedElements=p.changed_elements,
            totalElements=p.total_elements,
            changedPercent=f"{100 * p.changed_elements / p.total_elements:.2f}%",
        )
    if p.timings:
        out["timings"] = {k: round(v, 6) for k, v in p.timings.items()}
    if "latency_s" in p.timings:  # the coordinator's timed window of this attempt
        out["lastAttemptLatencySeconds"] = round(p.timings["latency_s"], 6)
        out["lastAttemptLatency"] = human_seconds(p.timings["latency_s"])
    return out


def stamp(moment: dt.datetime | None = None) -> str:
    """RFC 3339 in UTC with milliseconds: startTime and completionTime, whose difference is
    the transition's latency."""
    moment = moment or dt.datetime.now(dt.timezone.utc)
    return (
        moment.astimezone(dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )


def parse_stamp(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


def latency_status(start_time: str, completion_time: str) -> Obj:
    """LATENCY, defined once: from the transition's startTime (its first attempt began) to its
    completionTime (committed and finished, or confirmed by a restarted operator), across
    retries and takeovers."""
    seconds = max(0.0, (parse_stamp(completion_time) - parse_stamp(start_time)).total_seconds())
    return {"latencySeconds": round(seconds, 3), "latency": human_seconds(seconds)}


def failure_reason(result: TransitionResult) -> str:
    """A CamelCase reason for a transition that did not commit (the coordinator's own when it
    gave one)."""
    if result.reason:
        return result.reason
    return {"rejected": "PrepareRejected", "conflict": "CoordinatorConflict"}.get(
        result.outcome, "Aborted" if result.outcome == "aborted" else "Failed"
    )


def outcome_status(result: TransitionResult, start_time: str = "") -> Obj:
    """The status fields of a finished transition (on top of the last progress); with the
    transition's `start_time`, its latency."""
    out: Obj = {"phase": OUTCOME_PHASE.get(result.outcome, "Failed"), "completionTime": stamp()}
    if start_time:
        out.update(latency_status(start_time, out["completionTime"]))
    if result.attempts:  # 0: finished by `recover` (the attempts are already recorded)
        out.update(modes=list(result.modes), attempt=result.attempts)
    if result.outcome != "committed":
        out["reason"] = failure_reason(result)
        out["message"] = result.message or out["reason"]
    return out


def progress_summary(counts: Mapping[str, int]) -> str:
    """e.g. "staged 12, applied 9 on 2 nodes" (payload counts summed over the nodes)."""
    return (
        f"staged {counts.get('staged', 0)}, applied {counts.get('applied', 0)} "
        f"on {counts.get('nodes', 0)} nodes"
    )


class TransitionRecorder:
    """ProgressSink writing one RefitTransition (see the module docstring)."""

    def __init__(
        self,
        api: KubeApi,
        policy: Obj,
        from_version: int,
        to_version: int,
        *,
        coordinator: str,
        poll: ProgressPoll | None = None,
        min_interval_s: float = 1.0,
    ) -> None:
        self.api = api
        self.policy = policy
        self.namespace = policy["metadata"]["namespace"]
        self.policy_name = policy["metadata"]["name"]
        self.from_version = from_version
        self.to_version = to_version
        self.coordinator = coordinator
        self.poll = poll
        self.min_interval_s = min_interval_s
        self.name = ""
        self.ref: Obj = {}
        self.takeovers = 0
        self.restored: list[str] = []
        self.start_time = ""  # status.startTime: when the first attempt began
        self._phase = ""
        self._message = ""  # the last message written
        self._attempt = 0  # the last attempt number shown
        self._base = 0  # attempts made by coordinators before a takeover
        self._modes: list[str] = []  # mode of every attempt shown, in order
        self._noticed = 0  # progress.notices announced as Events
        self._last_patch = 0.0
        self._poller: asyncio.Task[None] | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    async def open(self, *, create: bool = True) -> bool:
        """Continue the newest unfinished RefitTransition of this version, or create one.

        Returns True when an unfinished one existed (a takeover). With `create` False only an
        existing one is continued."""
        existing = await self._for_version()
        unfinished = [t for t in existing if t.get("status", {}).get("phase") not in TERMINAL]
        if unfinished:
            obj = unfinished[-1]
            self.name = obj["metadata"]["name"]
            self.ref = object_ref(obj)
            status = obj.get("status") or {}
            self.takeovers = int(status.get("takeovers") or 0) + 1
            self.restored = list((status.get("receivers") or {}).get("restored") or [])
            self._phase = status.get("phase", "")
            self.start_time = str(status.get("startTime") or "")
            self._base = self._attempt = int(status.get("attempt") or 0)
            self._modes = list(status.get("modes") or [])[: self._base]
            await self._patch(
                {"takeovers": self.takeovers, "coordinator": self.coordinator}, force=True
            )
            await self._event(
                "TakenOver",
                f"{self.coordinator} continues this transition after its previous coordinator "
                f"stopped (takeover {self.takeovers})",
            )
            return True
        if not create:
            return False
        first = max((try_number(t) + 1 for t in existing), default=0)
        created: Obj | None = None
        for n in range(first, first + 8):
            self.name = transition_name(self.policy_name, self.to_version, n)
            created = await self._create()
            if created is not None:
                break
        if created is None:
            raise ConflictError(f"no free RefitTransition name for v{self.to_version}")
        self.ref = object_ref(created)
        self.start_time = stamp()
        await self._patch(
            {
                "phase": "Pending",
                "startTime": self.start_time,
                "coordinator": self.coordinator,
                "takeovers": 0,
            },
            force=True,
        )
        await self._event("Started", f"v{self.from_version} -> v{self.to_version}")
        return False

    async def _create(self) -> Obj | None:
        """Create `self.name`; None if a finished one already has that name (pruned lists lag,
        a coordinator that stopped right after creating it leaves an unfinished one: that one
        is continued)."""
        body = {
            "apiVersion": API_VERSION,
            "kind": "RefitTransition",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "labels": {POLICY: self.policy_name},
                "ownerReferences": [owner_reference(self.policy)],
            },
            "spec": {
                "policy": self.policy_name,
                "fromVersion": self.from_version,
                "toVersion": self.to_version,
            },
        }
        try:
            return await self.api.create_transition(self.namespace, body)
        except ConflictError:
            obj = await self.api.get_transition(self.namespace, self.name)
            return None if obj.get("status", {}).get("phase") in TERMINAL else obj

    async def update(self, progress: TransitionProgress) -> None:
        """ProgressSink: every phase change is written and announced, every new message
        written; the rest rate-limited.

        Attempts continue the count of the coordinators before a takeover."""
        if progress.phase in TERMINAL:
            return  # the outcome is written once, by `finish`
        changed = progress.phase != self._phase
        attempt = self._base + progress.attempt
        retry = attempt > max(self._attempt, 1)
        status = progress_status(progress)
        status["attempt"] = attempt
        if attempt > len(self._modes):
            self._modes.append(progress.mode)
            status["modes"] = list(self._modes)
        if progress.phase != "Streaming":
            await self._stop_poller()
        said = progress.message != self._message
        await self._patch(status, force=changed or retry or said)
        self._message = progress.message
        for reason, notice in progress.notices[self._noticed :]:
            await self._event(reason, notice, warning=True)
        self._noticed = len(progress.notices)
        if retry:
            why = progress.message or "after a takeover"
            await self._event(
                "Retry", f"attempt {attempt} in {progress.mode} mode: {why}", warning=True
            )
        self._attempt = max(self._attempt, attempt)
        if changed:
            self._phase = progress.phase
            await self._event(
                progress.phase,
                f"attempt {attempt} ({progress.mode}): {progress.phase.lower()}"
                + (f": {progress.message}" if progress.message else ""),
            )
            if progress.phase == "Streaming" and self.poll is not None:
                self._poller = asyncio.create_task(self._poll_progress())

    async def restored_node(self, node: str, how: str) -> None:
        self.restored.append(node)
        await self._patch({"receivers": {"restored": sorted(set(self.restored))}}, force=True)
        await self._event("Restored", f"{node}: {how}")

    async def finish(
        self,
        result: TransitionResult,
        required: list[str] | None,
        servers: Mapping[str, list[str]] | None = None,
    ) -> None:
        """Write the outcome once. `required`: the receivers of the last attempt (None keeps
        what is recorded); `servers`: those of them that are one vLLM server spanning several
        pods, by server. A coordinator fenced by a newer one (`conflict`) only posts an
        Event: the object may already be continued by the coordinator that took over."""
        await self._stop_poller()
        ok = result.outcome == "committed"
        if result.outcome == "conflict":
            await self._event(
                "Conflict",
                f"{self.coordinator} stopped: {result.message or 'another coordinator took over'}",
                warning=True,
            )
            return
        status = progress_status(result.progress) if result.progress else {}
        status.update(outcome_status(result, self.start_time))
        if result.attempts:
            status["attempt"] = self._base + result.attempts
            status["modes"] = self._modes[: self._base] + list(result.modes)
        receivers: Obj = {"retired": sorted(set(result.retired))}
        receivers["restored"] = sorted(set(self.restored))
        if required is not None:
            receivers["required"] = sorted(required)
        if servers:
            receivers["servers"] = {name: sorted(pods) for name, pods in servers.items()}
        status["receivers"] = receivers
        self._phase = status["phase"]
        await self._patch(status, force=True)
        what = (
            f"v{self.to_version} committed after {status.get('attempt', self._attempt)} "
            f"attempt(s) ({', '.join(status.get('modes') or self._modes)})"
            if ok
            else f"{status['reason']}: {status['message']}"
        )
        await self._event(status["phase"], what, warning=not ok)

    async def close(self) -> None:
        await self._stop_poller()

    # -- helpers --------------------------------------------------------------------------------
    async def _for_version(self) -> list[Obj]:
        items = await self.api.list_transitions(self.namespace)
        mine = [
            t
            for t in items
            if t.get("spec", {}).get("policy") == self.policy_name
            and t.get("spec", {}).get("toVersion") == self.to_version
        ]
        return sorted(mine, key=_order)

    async def _patch(self, status: Obj, *, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._last_patch < self.min_interval_s:
            return
        self._last_patch = now
        try:
            await self.api.patch_transition_status(self.namespace, self.name, status)
        except NotFoundError:
            log.warning("transition.gone", name=self.name)
        except Exception as exc:  # best effort: the next update writes the phase again
            log.warning("transition.patch_failed", name=self.name, error=str(exc))
            self._phase = ""

    async def _event(self, reason: str, message: str, *, warning: bool = False) -> None:
        try:
            await self.api.post_event(self.ref, reason, message, warning=warning)
        except Exception as exc:  # an Event is best effort: never fail a transition for one
            log.warning("event.failed", name=self.name, reason=reason, error=str(exc))

    async def _poll_progress(self) -> None:
        assert self.poll is not None
        while True:
            await asyncio.sleep(self.min_interval_s)
            try:
                counts = dict(await self.poll())
            except Exception as exc:
                log.info("transition.progress_poll_failed", error=str(exc))
                continue
            counts["summary"] = progress_summary(counts)  # type: ignore[assignment]
            await self._patch({"progress": counts}, force=True)

    async def _stop_poller(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._poller
            self._poller = None


def sorted_finished(items: list[Obj], policy: str) -> list[Obj]:
    """The policy's finished transitions, oldest first."""
    done = [
        t
        for t in items
        if t.get("spec", {}).get("policy") == policy
        and t.get("status", {}).get("phase") in TERMINAL
    ]
    return sorted(done, key=_order)


def to_prune(items: list[Obj], policy: str, keep: int) -> list[str]:
    """Names of finished transitions beyond the newest `keep`."""
    done = sorted_finished(items, policy)
    return [str(t["metadata"]["name"]) for t in done[: max(0, len(done) - keep)]]


async def prune(api: KubeApi, namespace: str, policy: str, keep: int) -> None:
    """Delete a policy's finished transitions beyond the newest `keep` (spec.keepTransitions)."""
    for name in to_prune(await api.list_transitions(namespace), policy, keep):
        with contextlib.suppress(NotFoundError):
            await api.delete_transition(namespace, name)
