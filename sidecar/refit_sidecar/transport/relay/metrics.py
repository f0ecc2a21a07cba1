"""The Prometheus series of a relay node (`RelayNode.metrics`)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from refit_protocol.kit.metrics import preset
from refit_protocol.kit.tokens import TOKEN_FILE_REJECTIONS, FileTokenRing, TokenRing
from refit_sidecar.transport.relay.frames import DATA, END, PROBE, AckStatus

#: Where an error the ROUTER loop survived was raised (`kuberefit_relay_loop_errors_total`).
LOOP_ERROR_PLACES = ("rotation", "monitor", "frame", "loop")


class TokenFileRejections(Collector):
    """`kuberefit_token_file_rejected_total{reason}`: the token file versions a ring refused
    (`FileTokenRing.rejections`; every reason present from the start)."""

    def __init__(self, ring: FileTokenRing) -> None:
        self._ring = ring

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "kuberefit_token_file_rejected",
            "Token file versions refused and not taken (the tokens in force were kept), by "
            f"reason: {', '.join(TOKEN_FILE_REJECTIONS)}.",
            labels=["reason"],
        )
        for reason, count in self._ring.rejections().items():
            family.add_metric([reason], count)
        yield family


class RelayMetrics:
    def __init__(self, registry: CollectorRegistry | None, ring: TokenRing | None = None) -> None:
        reg = registry if registry is not None else CollectorRegistry()
        self.frames = Counter(
            "kuberefit_relay_frames",
            "Frames handled, by kind and answer.",
            ["kind", "status"],
            registry=reg,
        )
        self.dropped = Counter(
            "kuberefit_relay_frames_dropped",
            "Frames dropped without an answer (unauthenticated: a wrong token, or on a MAC-only "
            "link a frame tag or payload that does not verify; malformed), connections refused "
            "at the CurveZMQ handshake (handshake: no key pair of the policy's token, or "
            "replayed or altered traffic, and on the MAC-only port a wrong link password; "
            "handshake_aborted: the peer hung up mid-handshake, e.g. a plain TCP connect).",
            ["reason"],
            registry=reg,
        )
        self.bytes = Counter(
            "kuberefit_relay_payload_bytes", "Payload bytes received in DATA frames.", registry=reg
        )
        self.forwards = Counter(
            "kuberefit_relay_forwards", "Child forwards by result.", ["result"], registry=reg
        )
        self.loop_errors = Counter(
            "kuberefit_relay_loop_errors",
            "Errors the relay's ROUTER loop caught and survived, by where they were raised "
            "(rotation: following the token ring or binding again; monitor: counting refused "
            "handshakes; frame: handling one frame; loop: anything else).",
            ["where"],
            registry=reg,
        )
        if isinstance(ring, FileTokenRing):
            reg.register(TokenFileRejections(ring))
        # Every known series exists at 0 before its first event (refit_protocol.kit.metrics).
        preset(self.frames, *((k.decode(), s.value) for k in (DATA, PROBE, END) for s in AckStatus))
        preset(
            self.dropped,
            "unauthenticated",
            "malformed",
            "handshake",
            "handshake_aborted",
        )
        preset(self.forwards, "ok", "failed", "skipped")
        preset(self.loop_errors, *LOOP_ERROR_PLACES)
