"""The control plane's commands (joined into `kuberefit` by `refit_protocol.kit.cli`).

Heavy dependencies are imported inside each command, so `kuberefit --help` works in the
operator image, which has no torch, vllm or zmq.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import click
import structlog

from refit_protocol.kit.cli import (
    STARTUP_ERROR_HELP,
    config_command,
    config_file_option,
    service_command,
)
from refit_protocol.kit.config_files import load_config

COORDINATOR_CONFIG = "refit_operator.coordinator_service:CoordinatorServiceConfig"
#: What `kuberefit coordinator serve` exits with (refit_operator.coordinator_service).
OPERATOR_EXIT_HELP = "Exit codes: 0 stopped by SIGTERM; 1 an unexpected error (traceback)."
COORDINATOR_EXIT_HELP = (
    "Exit codes: 0 done (until_version reached, or SIGTERM); 1 an unexpected error (traceback); "
    "2 refused start-up or a peer refusing the token; 3 aborted (operator intervention "
    "needed); 4 conflict (another coordinator took over)."
)


@click.group()
def commands() -> None:
    """Control plane: the coordinator (and the operator)."""


@commands.group()
def coordinator() -> None:
    """One policy's coordinator as a process: serve, or show/check its settings."""


@coordinator.command("serve", epilog=f"{STARTUP_ERROR_HELP} {COORDINATOR_EXIT_HELP}")
@config_file_option("CoordinatorServiceConfig (`kuberefit coordinator config --example`).")
@service_command
def coordinator_serve(config_path: Path) -> None:
    """Run one policy's coordinator (local mode with separate processes).

    Transitions start when every producer has staged the next version. Safe to SIGKILL: a new
    coordinator takes over from the commit store. SIGTERM stops it between steps (exit 0).
    """
    from refit_operator.coordinator_service import CoordinatorServiceConfig, serve
    from refit_protocol.kit.logs import configure_logging, log_settings

    configure_logging()
    config = load_config(CoordinatorServiceConfig, path=config_path)
    log_settings("coordinator", config)
    sys.exit(asyncio.run(_until_signal(serve(config))))


async def _until_signal(run: Coroutine[Any, Any, int]) -> int:
    """`run`'s exit code, or 0 when SIGTERM/SIGINT stops it (safe at any point: a new
    coordinator takes over from the commit store)."""
    task = asyncio.ensure_future(run)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        return await task
    except asyncio.CancelledError:
        structlog.get_logger("kuberefit.coordinator").info("coordinator.stopped", reason="signal")
        return 0


coordinator.add_command(config_command(COORDINATOR_CONFIG))


@commands.command()
@click.option(
    "--node",
    "nodes",
    multiple=True,
    required=True,
    help="A receiver's control-plane URL, e.g. http://10.0.0.5:8470 (repeat for each node).",
)
@click.option(
    "--checkpoint",
    required=True,
    help="The committed version's checkpoint directory, as the nodes' runtimes see it.",
)
@click.option("--version", "version", type=int, required=True, help="The committed version.")
@click.option(
    "--token-file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="File holding the policy's token (default $KUBEREFIT_TOKEN_FILE, $KUBEREFIT_TOKEN).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the nodes' answers as JSON.")
def verify(
    nodes: tuple[str, ...], checkpoint: str, version: int, token_file: Path | None, as_json: bool
) -> None:
    """Prove each node holds exactly what a dense load of the checkpoint would write.

    Every node runs its own loader over the checkpoint in compare mode (nothing is written) and
    reports mismatches with positions and bit patterns; a node with a mismatch stops serving
    until it is restored densely. Exit codes: 0 all nodes verified, 1 a node holds other bits,
    3 a node could not be compared (unreachable, busy, or holds another version).
    """
    import json as json_mod

    from refit_operator.verify import exit_code, render, verify_nodes
    from refit_protocol.kit.auth import open_ring

    ring = open_ring(None, token_file)
    results = asyncio.run(verify_nodes(nodes, checkpoint, version, token=ring))
    if as_json:
        click.echo(
            json_mod.dumps(
                [
                    {"url": r.url, "error": r.error}
                    | ({"answer": r.answer.model_dump()} if r.answer else {})
                    for r in results
                ]
            )
        )
    else:
        for line in render(results):
            click.echo(line)
    sys.exit(exit_code(results))


@commands.group("operator")
def operator_group() -> None:
    """The Kubernetes operator (what the Helm chart runs)."""


@operator_group.command("serve", epilog=f"{STARTUP_ERROR_HELP} {OPERATOR_EXIT_HELP}")
@click.option(
    "--namespace",
    "namespaces",
    multiple=True,
    help="Serve only this namespace (repeatable). Default: cluster-wide.",
)
@click.option(
    "--identity",
    default=None,
    help="Name this operator holds policy Leases under. Default: $POD_NAME, else host-pid. "
    "A restarted operator with the same identity takes its Leases back at once.",
)
@click.option(
    "--metrics-bind",
    default="0.0.0.0:8080",
    show_default=True,
    help="HOST:PORT of /healthz, /readyz and /metrics.",
)
@click.option(
    "--metrics-token-file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Bearer token /metrics requires (default $KUBEREFIT_TOKEN; needed unless loopback).",
)
@click.option(
    "--lease-seconds",
    type=click.IntRange(min=3),
    default=15,
    show_default=True,
    help="Lease duration: how long a killed operator's policies wait for another replica.",
)
@click.option(
    "--lease-namespace",
    default=None,
    help="Namespace of the policies' Leases (the operator's own, where its Role allows Lease "
    "writes). Default: $POD_NAMESPACE, else the one --namespace.",
)
@click.option(
    "--poll-seconds",
    type=click.FloatRange(min=0.01),
    default=0.5,
    show_default=True,
    help="How often each policy's loop looks for staged versions and pod changes.",
)
@click.option(
    "--webhook-bind",
    default=None,
    help="HOST:PORT of the sidecar-injecting admission webhook (HTTPS). Default: no webhook.",
)
@click.option(
    "--webhook-cert-dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Directory holding the webhook's tls.crt and tls.key (needed with --webhook-bind).",
)
@click.option(
    "--injection-config",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="JSON of what the webhook injects (the chart's injection.json). Default: the chart's "
    "default values.",
)
@click.option(
    "--webhook-drain-seconds",
    type=click.FloatRange(min=0, max=300),
    default=5.0,
    show_default=True,
    help="On SIGTERM, keep answering admission reviews this long, each answer closing its "
    "connection, so the API server moves to the replicas that stay (keep it below the pod's "
    "terminationGracePeriodSeconds).",
)
@service_command
def operator_serve(
    namespaces: tuple[str, ...],
    identity: str | None,
    metrics_bind: str,
    metrics_token_file: Path | None,
    lease_seconds: int,
    lease_namespace: str | None,
    poll_seconds: float,
    webhook_bind: str | None,
    webhook_cert_dir: Path | None,
    injection_config: Path | None,
    webhook_drain_seconds: float,
) -> None:
    """Run the kopf operator: one coordinator per RefitPolicy, pods discovered by annotation.

    Reads the cluster credentials of the kubernetes client (in-cluster service account, else
    $KUBECONFIG). See docs/operator.md.
    """
    from refit_operator.operator_main import OperatorConfig, run
    from refit_protocol.kit.logs import configure_logging, log_settings

    configure_logging()
    host, port = _host_port(metrics_bind, "--metrics-bind")
    fields: dict[str, object] = {
        "namespaces": list(namespaces),
        "metrics_host": host,
        "metrics_port": port,
        "metrics_token_file": metrics_token_file,
        "lease_s": lease_seconds,
        "poll_s": poll_seconds,
        "webhook_drain_s": webhook_drain_seconds,
    }
    if webhook_bind is not None:
        fields["webhook_host"], fields["webhook_port"] = _host_port(webhook_bind, "--webhook-bind")
    fields["webhook_cert_dir"], fields["injection_config"] = webhook_cert_dir, injection_config
    if identity:
        fields["identity"] = identity
    if lease_namespace:
        fields["lease_namespace"] = lease_namespace
    config = OperatorConfig.model_validate(fields)
    log_settings("operator", config)
    asyncio.run(run(config))  # errors: see service_command


@operator_group.command("selftest")
@click.option(
    "--webhook",
    "url",
    required=True,
    help="The webhook's URL, https://HOST[:PORT]/mutate-pods (the chart's Service or webhook.url).",
)
@click.option(
    "--ca-file",
    type=click.Path(path_type=Path, dir_okay=False),
    required=True,
    help="CA bundle the serving certificate must chain to (the chart's ca.crt).",
)
@click.option(
    "--namespace",
    default="default",
    show_default=True,
    help="Namespace of the sample pod: one the operator serves (operator.watchNamespaces).",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0.1, max=300),
    default=10.0,
    show_default=True,
    help="Seconds to wait for the answer.",
)
def operator_selftest(url: str, ca_file: Path, namespace: str, timeout_s: float) -> None:
    """Check that the webhook injects: what the chart's `helm test` runs.

    Posts a dry-run AdmissionReview of an opted-in sample pod, as the API server would, and
    passes when the answer adds the sidecar (nothing is created). Exit codes: 0 it does; 1 it
    does not (a FAIL line says what failed); 2 bad options.
    """
    from refit_operator.selftest import run_selftest

    if not url.startswith("https://"):
        raise click.BadParameter("the webhook is served over https only", param_hint="--webhook")
    result = run_selftest(url, ca_file, namespace, timeout_s)
    for line in result.lines:
        click.echo(line)
    sys.exit(0 if result.ok else 1)


def _host_port(value: str, flag: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise click.BadParameter(f"expected HOST:PORT, got {value!r}", param_hint=flag)
    return host.strip("[]"), int(port)
