"""The `s3` transport kind: object storage with manifest pointers (paper §7.1, NeMo RL's S3
path). The producer uploads every payload once; every rollout node downloads it."""

from __future__ import annotations

from refit_protocol.kit.tokens import TokenRing
from refit_protocol.producer_api import AttemptPlan
from refit_sidecar.transport.base import SendObserver, Transport
from refit_sidecar.transport.inbound import Inbound, PayloadSink
from refit_sidecar.transport.plugin import InboundContext, ReceiverUrls, TransportPlugin
from refit_sidecar.transport.s3.inbound import MANIFEST_PATH, STREAM_END_PATH, S3Inbound
from refit_sidecar.transport.s3.sender import S3Transport, S3TransportConfig
from refit_sidecar.transport.s3.store import (
    S3Config,
    attempt_prefix,
    delete_prefix,
    make_client,
    store_problem,
)


class S3Plugin(TransportPlugin[S3TransportConfig, S3Config]):
    kind = "s3"
    title = "S3 object storage"
    sender_config = S3TransportConfig
    receiver_field = "s3"
    http_paths = (MANIFEST_PATH, STREAM_END_PATH)

    def sender(
        self,
        config: S3TransportConfig,
        *,
        observer: SendObserver | None = None,
        tokens: TokenRing | None = None,
    ) -> Transport:
        if observer is not None:
            raise ValueError("the S3 transport reports no send intervals")
        return S3Transport(config, tokens=tokens)

    def destination(
        self, template: S3TransportConfig, plan: AttemptPlan, receiver_urls: ReceiverUrls | None
    ) -> str:
        """Every receiver of the plan, separated by spaces: their URLs from `receiver_urls`
        when given (a resolver of node names), else the plan's own (`receiver_urls`, which the
        coordinator fills in), else the template's fixed list."""
        if receiver_urls is not None:
            urls = receiver_urls(plan.receivers)
        else:
            urls = list(plan.receiver_urls) or list(template.receivers)
        if not urls:
            raise ValueError(
                f"attempt {plan.attempt} names no receiver URLs and the S3 transport has no "
                "`receivers` configured"
            )
        return " ".join(urls)

    def at(self, template: S3TransportConfig, destination: str) -> S3TransportConfig:
        return template.model_copy(update={"receivers": destination.split()})

    def probe(self, template: S3TransportConfig) -> str:
        return store_problem(template.s3)

    def leftovers(self, template: S3TransportConfig, attempt: str) -> None:
        cfg = template.s3
        delete_prefix(make_client(cfg), cfg.bucket, attempt_prefix(cfg, attempt))

    def inbound(self, settings: S3Config, sink: PayloadSink, context: InboundContext) -> Inbound:
        return S3Inbound(settings, sink, context)
