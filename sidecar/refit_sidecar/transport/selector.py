"""A producer's transport for each attempt: where its payloads go is named by the attempt plan.

On the relay tree a producer sends to the tree's root, which the coordinator names per attempt
(`AttemptPlan.relay_tree[0]`, since membership changes between attempts); over S3 it announces
each payload to the attempt's receivers. The kind's plug-in says where (`destination`); one
transport is made per destination and reused by later attempts to the same place; `close`
closes them all. It also speaks for the kind where no attempt's transport does: `problem`
(why nothing could be sent, checked in the background, for the producer's status) and
`leftovers` (an attempt's objects, for a producer restarted since the attempt).
"""

from __future__ import annotations

import math
import threading
import time

import structlog
from pydantic import BaseModel

from refit_protocol.kit.tokens import TokenRing
from refit_protocol.producer_api import AttemptPlan
from refit_sidecar.transport import for_sender
from refit_sidecar.transport.base import SendObserver, Transport
from refit_sidecar.transport.plugin import ReceiverUrls

log = structlog.get_logger("kuberefit.transport")
#: How old the medium's last check may be before `problem` starts another.
PROBE_EVERY_S = 30.0


class TransportSelector:
    """Callable as `ProducerService`'s transport factory: `selector(plan) -> Transport`.

    `template` holds every setting but the destination; its kind's plug-in fills in each plan's
    (`TransportPlugin.destination`: the relay tree's root, or the receivers' URLs, mapped from
    the plan's node names by `receiver_urls` when given, else the template's)."""

    def __init__(
        self,
        template: BaseModel,
        *,
        receiver_urls: ReceiverUrls | None = None,
        observer: SendObserver | None = None,
        tokens: TokenRing | None = None,
    ) -> None:
        self.template = template
        self.plugin = for_sender(template)
        self._tokens = tokens
        self._receiver_urls = receiver_urls
        self._observer = observer
        self._made: dict[str, Transport] = {}
        self._lock = threading.Lock()
        self._problem, self._probed_at, self._probing = "", -math.inf, False

    def __call__(self, plan: AttemptPlan) -> Transport:
        return self.to(self.plugin.destination(self.template, plan, self._receiver_urls))

    def to(self, destination: str) -> Transport:
        """The transport to `destination` as the kind spells one (a root relay endpoint;
        receiver URLs separated by spaces), made on first use."""
        with self._lock:
            if destination not in self._made:
                config = self.plugin.at(self.template, destination)
                self._made[destination] = self.plugin.sender(
                    config, observer=self._observer, tokens=self._tokens
                )
            return self._made[destination]

    def problem(self) -> str:
        """Why this producer cannot send ("" : it can, or not checked yet), as of the last
        check; a check older than `PROBE_EVERY_S` starts another in the background (never
        blocks: the status answer that reads it must stay fast)."""
        with self._lock:
            start = not self._probing and time.monotonic() - self._probed_at > PROBE_EVERY_S
            self._probing = self._probing or start
            found = self._problem
        if start:
            threading.Thread(target=self.check_now, name="transport-probe", daemon=True).start()
        return found

    def check_now(self) -> str:
        """Check the medium in this thread; remember and return the answer."""
        try:
            found = self.plugin.probe(self.template)
        except Exception as exc:  # a check that fails is itself the answer
            found = f"{self.plugin.title}: {type(exc).__name__}: {str(exc)[:300]}"
        if found and found != self._problem:
            log.warning("transport.problem", problem=found)
        elif self._problem and not found:
            log.info("transport.problem_cleared")
        with self._lock:
            self._problem, self._probed_at, self._probing = found, time.monotonic(), False
        return found

    def leftovers(self, attempt: str) -> None:
        """Delete what `attempt` left in the medium (no transport of it is held here)."""
        self.plugin.leftovers(self.template, attempt)

    def close(self) -> None:
        with self._lock:
            made, self._made = list(self._made.values()), {}
        for t in made:  # `close` is not a Transport call: both kinds have one
            close = getattr(t, "close", None)
            if close is not None:
                close()
