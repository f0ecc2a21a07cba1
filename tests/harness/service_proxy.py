"""kube-proxy's part for one Service port, for the harness (which has no kube-proxy): TCP
connections to a fixed local address go to one of the Service's ready endpoints, round robin.

The test sets the endpoints as the endpoints controller would: a pod joins once it is ready and
leaves before it is stopped. With no endpoint a connection is refused (closed at once), as a
Service without ready pods refuses it. Bytes are forwarded as they are (TLS passes through).
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
from collections.abc import Iterator


class ServiceProxy:
    """Listens on 127.0.0.1:`port` (0: a free one) and forwards each connection."""

    def __init__(self, port: int = 0) -> None:
        self._server = socket.create_server(("127.0.0.1", port))
        self.port = int(self._server.getsockname()[1])
        self._lock = threading.Lock()
        self._endpoints: list[tuple[str, int]] = []
        self._turn: Iterator[int] = itertools.count()
        self._closed = False
        threading.Thread(target=self._accept, name="service-proxy", daemon=True).start()

    def set_endpoints(self, endpoints: list[tuple[str, int]]) -> None:
        with self._lock:
            self._endpoints = list(endpoints)

    def add(self, endpoint: tuple[str, int]) -> None:
        with self._lock:
            self._endpoints.append(endpoint)

    def remove(self, endpoint: tuple[str, int]) -> None:
        with self._lock:
            self._endpoints = [e for e in self._endpoints if e != endpoint]

    def close(self) -> None:
        self._closed = True
        self._server.close()

    def _pick(self) -> tuple[str, int] | None:
        with self._lock:
            if not self._endpoints:
                return None
            return self._endpoints[next(self._turn) % len(self._endpoints)]

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            endpoint = self._pick()
            if endpoint is None:
                client.close()
                continue
            try:
                upstream = socket.create_connection(endpoint, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            _Connection(client, upstream)


class _Connection:
    """One forwarded connection: a pump each way; both sockets closed once both ended."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self._sockets = (client, upstream)
        self._left = 2
        self._lock = threading.Lock()
        for src, dst in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        """Copy `src` to `dst` until `src` ends, then end `dst`'s sending side."""
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
        with self._lock:
            self._left -= 1
            done = self._left == 0
        if done:
            for sock in self._sockets:
                sock.close()
