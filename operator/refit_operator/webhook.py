"""The mutating admission webhook, served by the operator over HTTPS (`--webhook-bind`).

Thin on purpose: `POST /mutate-pods` parses the AdmissionReview, looks up the pod's RefitPolicy
(for its token Secret and producer count) and answers with what the pure `injection.inject`
decides. The API server is the only client meant: TLS with the chart's serving certificate
(reloaded when the files change, so cert-manager rotations need no restart); admission requests
carry no token (the API server authenticates to webhooks only with client certificates, which
the chart does not configure), so this endpoint changes nothing but the admitted object.

Anyone who reaches the port may post anything, so the answer is always an AdmissionReview
(allowed, or denied with a reason) or an error status that says why: 413 for a body over
`MAX_REVIEW_BYTES` (refused while it is read), 400 for one that is not an AdmissionReview of a
Pod (`injection.parse_review`: strict JSON, bounded nesting, one validated model; the message
names the field). A failure while deciding denies the pod with a reason, never a 500.

Stopping never costs a pod its sidecar (`WebhookServer.stop`): the API server keeps its
connections to this pod open after the pod has left the Service, and a connection the server
closes just as a review is sent on it fails that review, which `failurePolicy: Ignore` turns into
a pod admitted without its sidecar. So the server first drains: for `--webhook-drain-seconds` it
keeps answering, new connections included, and every answer says `Connection: close`, so the API
server drops each connection after its review and opens the next one to a pod that stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from dataclasses import dataclass
from pathlib import Path

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler

from refit_operator.admission_reads import PolicyReads, review_deadline
from refit_operator.injection import (
    Injection,
    InjectionConfig,
    PolicyFacts,
    ReviewError,
    TrainerSettings,
    inject,
    parse_review,
    review_response,
    wants_injection,
)
from refit_operator.injection.config import TokenSecretRef
from refit_operator.injection.review import PodAdmission
from refit_operator.kube.api import KubeApi, NotFoundError
from refit_operator.kube.names import POLICY
from refit_operator.metrics import ADMISSIONS
from refit_operator.policy_spec import SpecError, parse_spec
from refit_protocol.kit.http_log import request_logger
from refit_protocol.kit.service_http import error_response, json_errors

log = structlog.get_logger("kuberefit.webhook")

PATH = "/mutate-pods"
#: The API server sends whole Pod objects; 8 MiB is far above any real one (the API server's
#: own request bodies are capped at 3 MiB by default). A larger body is refused with 413 while
#: it is read.
MAX_REVIEW_BYTES = 8 << 20
CERT_RELOAD_S = 60.0
#: What the API server waits for the webhook when its review names no `timeout` (the chart's
#: webhook.timeoutSeconds default); a review's policy read gets most of it (`review_deadline`).
DEFAULT_TIMEOUT_S = 5.0
#: How long a stopping webhook keeps answering with `Connection: close` (`WebhookServer.stop`).
DEFAULT_DRAIN_S = 5.0
#: Distinct policies read at once: a flood of reviews may not starve the policy loops' threads.
POLICY_READS_AT_ONCE = 8


@dataclass(frozen=True)
class PolicyLookup:
    """What admission learned of the pod's RefitPolicy."""

    facts: PolicyFacts
    warnings: list[str]
    #: Set when the policy could not be read in time: the review is denied with this message.
    denied: str | None = None


async def policy_facts(
    reads: PolicyReads, namespace: str, name: str, config: InjectionConfig, deadline_s: float
) -> PolicyLookup:
    """The pod's policy as admission needs it.

    A policy that does not exist (yet) gives the chart's defaults. One that exists but cannot
    be read within the review's deadline denies the pod with a message that says so: admitted
    with the defaults it would run with other settings than its policy's, and admitted without
    the sidecar it would never refit. Its controller retries the creation."""
    default = PolicyFacts(exists=False, token_secret=config.default_token_secret)
    try:
        obj = await reads.get(namespace, name, deadline_s)
    except NotFoundError:
        return PolicyLookup(default, [])
    except Exception as exc:  # the API server slow or failing: refuse, never guess
        if getattr(exc, "status", None) == 403:
            return PolicyLookup(
                default,
                [],
                denied=(
                    f"KubeRefit does not serve namespace {namespace} (the operator may not read "
                    "its RefitPolicies: the chart's operator.watchNamespaces): add the namespace "
                    "there, or remove the pod's kuberefit.io/inject annotation"
                ),
            )
        why = (
            f"no answer within {deadline_s:.1f} s"
            if isinstance(exc, (TimeoutError, asyncio.TimeoutError))
            else f"{type(exc).__name__}: {str(exc)[:200]}"
        )
        log.warning("webhook.policy_unreadable", namespace=namespace, policy=name, error=why)
        return PolicyLookup(
            default,
            [],
            denied=(
                f"KubeRefit could not read RefitPolicy {namespace}/{name} for this pod ({why}); "
                "the pod is refused rather than started with other settings than its policy's. "
                "Its controller retries; check the operator's access to the API server."
            )[:1000],
        )
    try:
        spec = parse_spec(obj.get("spec") or {})
    except SpecError as exc:
        return PolicyLookup(
            default, [f"RefitPolicy {name} is invalid ({exc}); used the chart defaults"]
        )
    token = TokenSecretRef(name=spec.token_secret.name, key=spec.token_secret.key)
    trainer = TrainerSettings(
        zstd_level=spec.encoding.zstd_level,
        shuffle=spec.encoding.shuffle,
        export_chunk_bytes=spec.chunk_bytes,
        bucket_bytes=spec.bucket_bytes,
        in_memory=spec.baseline.storage == "memory",
    )
    facts = PolicyFacts(
        True,
        token,
        producers=spec.producers,
        trainer=trainer,
        token_rotation_grace_s=float(spec.token_rotation_grace_seconds),
        s3=spec.s3_settings(),
    )
    return PolicyLookup(facts, [])


class Drain:
    """Whether the server is draining: from then on each answer closes its connection."""

    def __init__(self) -> None:
        self.since: float | None = None

    def begin(self) -> None:
        if self.since is None:
            self.since = asyncio.get_running_loop().time()
            log.info("webhook.draining")

    def remaining(self, drain_s: float) -> float:
        """Seconds of `drain_s` still to go (the drain begins now if it has not)."""
        self.begin()
        assert self.since is not None
        return max(0.0, self.since + drain_s - asyncio.get_running_loop().time())


DRAIN = web.AppKey("drain", Drain)


@web.middleware
async def close_while_draining(request: web.Request, handler: Handler) -> web.StreamResponse:
    response = await handler(request)
    if request.app[DRAIN].since is not None:
        response.force_close()  # `Connection: close`: the next review takes a new connection
    return response


def webhook_app(api: KubeApi, config: InjectionConfig) -> web.Application:
    reads = PolicyReads(api.get_policy, at_once=POLICY_READS_AT_ONCE)

    async def mutate(request: web.Request) -> web.Response:
        try:
            admission = parse_review(await request.read())
        except ReviewError as exc:
            ADMISSIONS.labels("invalid").inc()
            return error_response(400, str(exc))
        pod = admission.pod
        try:
            decision = await decide(admission, request.query.get("timeout"))
        except Exception as exc:  # a bug: deny with a reason (its controller retries), no 500
            log.exception("webhook.decision_failed", namespace=admission.namespace)
            decision = Injection(
                denied=(
                    f"KubeRefit failed to decide on this pod ({type(exc).__name__}); it is "
                    "refused rather than started without its sidecar. Please report this."
                )
            )
        result = "denied" if decision.denied else "injected" if decision.patch else "unchanged"
        ADMISSIONS.labels(result).inc()
        if result != "unchanged" or decision.warnings:
            log.info(
                "webhook.admission",
                result=result,
                namespace=admission.namespace,
                pod=pod.meta.name or pod.meta.generate_name,
                dry_run=admission.dry_run,
                reason=decision.denied,
                warnings=decision.warnings or None,
            )
        return web.json_response(review_response(admission.uid, decision))

    async def decide(admission: PodAdmission, timeout: str | None) -> Injection:
        pod = admission.pod
        lookup = PolicyLookup(PolicyFacts(False, config.default_token_secret), [])
        creating = admission.operation == "CREATE"  # a running pod's containers are immutable
        if creating and wants_injection(pod):
            policy = pod.annotations.get(POLICY, "")
            if policy:
                deadline = review_deadline(timeout, DEFAULT_TIMEOUT_S)
                lookup = await policy_facts(reads, admission.namespace, policy, config, deadline)
        if lookup.denied:
            decision = Injection(denied=lookup.denied)
        else:
            decision = inject(pod, config, lookup.facts) if creating else Injection()
        decision.warnings[:0] = lookup.warnings
        return decision

    app = web.Application(
        middlewares=[close_while_draining, request_logger("webhook"), json_errors],
        client_max_size=MAX_REVIEW_BYTES,
    )
    app[DRAIN] = Drain()
    app.router.add_post(PATH, mutate)
    return app


class ServingCert:
    """The webhook's TLS context, reloaded when tls.crt or tls.key change on disk."""

    def __init__(self, cert_dir: Path) -> None:
        self.cert, self.key = cert_dir / "tls.crt", cert_dir / "tls.key"
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._stamp = self._load()

    def _load(self) -> tuple[float, float]:
        try:
            stamp = (self.cert.stat().st_mtime, self.key.stat().st_mtime)
            # A pair that does not load (e.g. a rotation caught half-written) is tried on a
            # scratch context first, so the live one keeps serving the previous certificate.
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.cert, self.key)
            self.context.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"--webhook-cert-dir: cannot load {self.cert} and {self.key}: {exc}"
            ) from None
        return stamp

    def reload_if_changed(self) -> bool:
        try:
            stamp = (self.cert.stat().st_mtime, self.key.stat().st_mtime)
        except OSError:
            return False
        if stamp == self._stamp:
            return False
        try:
            self._stamp = self._load()
        except ValueError as exc:
            log.warning("webhook.cert_reload_failed", error=str(exc))
            return False
        log.info("webhook.cert_reloaded", cert=str(self.cert))
        return True


@dataclass
class WebhookServer:
    """The running HTTPS server and its certificate reloader."""

    runner: web.AppRunner
    reloader: asyncio.Task[None]
    drain: Drain

    async def stop(self, drain_s: float = DEFAULT_DRAIN_S) -> None:
        """Answer for `drain_s` more seconds, each answer closing its connection (the module
        docstring says why), then close: reviews in flight are answered, idle connections
        closed."""
        await asyncio.sleep(self.drain.remaining(drain_s))
        self.reloader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.reloader
        await self.runner.cleanup()
        log.info("webhook.stopped")


async def serve_webhook(
    api: KubeApi, config: InjectionConfig, host: str, port: int, cert_dir: Path
) -> WebhookServer:
    """Start the HTTPS server on host:port with the certificate in `cert_dir`."""
    cert = ServingCert(cert_dir)
    app = webhook_app(api, config)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port, ssl_context=cert.context).start()

    async def reload_loop() -> None:
        while True:
            await asyncio.sleep(CERT_RELOAD_S)
            cert.reload_if_changed()

    log.info("webhook.serving", bind=f"{host}:{port}", path=PATH)
    reloader = asyncio.get_running_loop().create_task(reload_loop())
    return WebhookServer(runner, reloader, app[DRAIN])
