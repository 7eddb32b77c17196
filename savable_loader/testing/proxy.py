"""A loopback HTTP proxy that delays and breaks an object store's answers, for tests.

:class:`FaultProxy` stands between a client (s3fs, botocore) and an S3 endpoint on
loopback (moto's server) and forwards every request: any method, headers, body, ``Range``.
On the way it makes the store look distant or flaky, to test a pipeline against it: a
fixed first-byte latency, a share of object reads answered ``503 SlowDown`` (S3's
throttling error) or cut mid-body, a permanent ``403 AccessDenied`` for chosen keys. It
counts what it did (:attr:`FaultProxy.stats`): a test checks that faults occurred, not
only that the pipeline survived. ``latency``, ``slow_down``, ``cut`` and ``deny`` are
attributes, changeable while it serves (upload without faults, then switch them on).
Standard library only: ``http.server`` threads in front (HTTP/1.1, connections kept
alive), an ``http.client`` connection to the upstream per request behind.

NOTE [ Which requests are faulted ]
A 503 or a cut goes only to requests that a reader makes and may safely repeat: GET and
HEAD (``methods``) of an object, a path-style path naming a key after the bucket
(``/bucket/key``). Bucket requests (create, list) and uploads pass, so a test's setup
cannot fail and a listing stays exact. One draw of a seeded ``random.Random``, under a
lock, decides each such request: below ``slow_down`` a 503, below ``slow_down + cut`` (GET
only) a cut; so the same number of such requests meets the same number of faults, whatever
the threads' order. A path matching ``deny`` draws nothing and is answered 403.

NOTE [ A cut answer ]
A cut looks to the client like a dropped connection: the upstream's status and headers,
``Content-Length`` included, about half of the body, then the connection closes. Only a
200 or 206 answer with a body is cut (errors stay whole, as a store's own do); a GET drawn
for a cut whose answer is neither is forwarded whole and not counted.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import logging
import random
import re
import socket
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import IO, Any
from urllib.parse import unquote, urlsplit
from xml.sax.saxutils import escape

__all__ = ["FaultProxy", "ProxyStats"]

logger = logging.getLogger(__name__)

# Never forwarded. A request's body is read by its Content-Length (S3 clients send one).
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "te", "trailer", "upgrade", "expect", "transfer-encoding"}
)
_ERRORS = {
    "deny": (403, "AccessDenied", "Access Denied"),
    "slow_down": (503, "SlowDown", "Please reduce your request rate."),
}


@dataclass(frozen=True)
class ProxyStats:
    """What a :class:`FaultProxy` did so far.

    Attributes:
        requests: Requests received.
        forwarded: Requests forwarded to the upstream (the cut ones included).
        slow_downs: Requests answered ``503 SlowDown`` without forwarding.
        cuts: Answers cut mid-body (NOTE [ A cut answer ]).
        denials: Requests answered ``403 AccessDenied`` without forwarding.
        failures: Requests the upstream did not answer (answered ``502``).
    """

    requests: int = 0
    forwarded: int = 0
    slow_downs: int = 0
    cuts: int = 0
    denials: int = 0
    failures: int = 0


class FaultProxy:
    """A reverse proxy on 127.0.0.1 (:attr:`url`) in front of ``upstream``, adding latency
    and faults. Serves once started, as a context manager or between :meth:`start` and
    :meth:`close`, in threads named ``fault-proxy:PORT...``, which closing joins.

    Args:
        upstream: ``http://host:port`` to forward to.
        latency: Seconds every answer waits before it starts (first-byte latency).
        slow_down: Share of faultable requests answered ``503 SlowDown``
            (NOTE [ Which requests are faulted ]).
        cut: Share of faultable GETs whose answer is cut mid-body (NOTE [ A cut answer ]).
        deny: Paths answered ``403 AccessDenied``: a regex searched in the request's path
            (unquoted, without its query and leading slash: ``bucket/key``), or keys, each
            matching a path equal to it or ending in ``/`` and it.
        methods: The methods that may be faulted.
        seed: Seed of the draws that choose the faulted requests.
        timeout: Seconds a socket (to the client or the upstream) may stay silent.

    Raises:
        ValueError: ``upstream`` is not an ``http://host:port`` URL.
    """

    def __init__(
        self,
        upstream: str,
        *,
        latency: float = 0.0,
        slow_down: float = 0.0,
        cut: float = 0.0,
        deny: Collection[str] | re.Pattern[str] = (),
        methods: Collection[str] = ("GET", "HEAD"),
        seed: int = 0,
        timeout: float = 60.0,
    ) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname or parts.path.strip("/"):
            raise ValueError(f"FaultProxy needs an http://host:port upstream, got {upstream!r}")
        self.upstream, self.address = upstream, (parts.hostname, parts.port or 80)
        self.latency, self.slow_down, self.cut, self.deny = latency, slow_down, cut, deny
        self.methods, self.timeout = frozenset(method.upper() for method in methods), timeout
        self.lock = threading.Lock()
        self._rng = random.Random(seed)
        self._counts = {field.name: 0 for field in fields(ProxyStats)}
        self._server = _Server(self)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name=self._server.name, daemon=True
        )

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``, for the client."""
        return f"http://127.0.0.1:{self._server.server_port}"

    @property
    def stats(self) -> ProxyStats:
        """A snapshot of the counts (:class:`ProxyStats`)."""
        with self.lock:
            return ProxyStats(**self._counts)

    def start(self) -> FaultProxy:
        """Starts serving (once); returns the proxy."""
        if self._thread.ident is None:
            self._thread.start()
        return self

    def close(self) -> None:
        """Stops serving, ends every connection and joins every thread; idempotent."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def count(self, name: str) -> None:
        with self.lock:
            self._counts[name] += 1

    def decide(self, method: str, path: str) -> str | None:
        """Counts a request and chooses its fault: "deny", "slow_down", "cut" or None."""
        if isinstance(deny := self.deny, re.Pattern):
            denied = deny.search(path) is not None
        else:
            denied = any(path == key or path.endswith("/" + key) for key in deny)
        bucket, _, key = path.partition("/")
        with self.lock:
            self._counts["requests"] += 1
            if denied:
                self._counts["denials"] += 1
                return "deny"
            if method not in self.methods or not bucket or not key:
                return None
            draw = self._rng.random()
            if draw < self.slow_down:
                self._counts["slow_downs"] += 1
                return "slow_down"
        return "cut" if method == "GET" and draw < self.slow_down + self.cut else None


class _Server(ThreadingHTTPServer):
    """Serves each connection in a named thread; closing ends and joins them all."""

    request_queue_size = 128

    def __init__(self, proxy: FaultProxy) -> None:
        self.proxy = proxy
        self.connections: dict[Any, threading.Thread] = {}
        super().__init__(("127.0.0.1", 0), _Handler)
        self.name = f"fault-proxy:{self.server_port}"

    def process_request(self, request: Any, client_address: Any) -> None:
        name, args = f"{self.name}-connection-{client_address[1]}", (request, client_address)
        thread = threading.Thread(target=self.process_request_thread, args=args, name=name)
        thread.daemon = True
        with self.proxy.lock:
            self.connections = {r: t for r, t in self.connections.items() if t.is_alive()}
            self.connections[request] = thread
        thread.start()

    def server_close(self) -> None:
        super().server_close()
        with self.proxy.lock:
            connections = list(self.connections.items())
        for request, thread in connections:
            with contextlib.suppress(OSError):
                request.shutdown(socket.SHUT_RDWR)
            thread.join()

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("fault proxy: connection from %s ended", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    """Forwards one client connection's requests, faulting some."""

    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.proxy.timeout)
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no 40 ms stalls

    def __getattr__(self, name: str) -> Callable[[], None]:
        if name.startswith("do_"):  # every method is forwarded
            return self.forward
        raise AttributeError(name)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("fault proxy: " + format, *args)

    def forward(self) -> None:
        proxy = self.server.proxy
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length > 0 else None
        path = unquote(urlsplit(self.path).path).lstrip("/")
        fault = proxy.decide(self.command, path)
        time.sleep(proxy.latency)
        if fault in _ERRORS:
            return self.error(*_ERRORS[fault], path)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        upstream = http.client.HTTPConnection(*proxy.address, timeout=proxy.timeout)
        with contextlib.closing(upstream):
            try:
                upstream.request(self.command, self.path, body, headers | {"Connection": "close"})
                response = upstream.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                proxy.count("failures")
                return self.error(502, "BadGateway", f"The upstream did not answer: {exc}", path)
            proxy.count("forwarded")
            self.relay(response, cut=fault == "cut")

    def relay(self, response: http.client.HTTPResponse, *, cut: bool) -> None:
        """Sends the upstream's answer on, or half of it (NOTE [ A cut answer ])."""
        headers = [(k, v) for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP]
        status, length = response.status, response.length
        body: IO[bytes] = response
        if self.command == "HEAD" or status in (204, 304) or status < 200:
            length = 0
        elif length is None:  # chunked, or up to the end: buffered and measured
            data = response.read()
            length, body = len(data), io.BytesIO(data)
            headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
            headers.append(("Content-Length", str(length)))
        cut = cut and status in (200, 206) and length > 0
        self.send_response_only(status, response.reason)
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        remaining = length // 2 if cut else length
        while remaining > 0 and (piece := body.read(min(remaining, 1 << 16))):
            self.wfile.write(piece)
            remaining -= len(piece)
        if cut:
            self.server.proxy.count("cuts")
        if cut or remaining:  # the client cannot tell where this answer ended: close
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_WR)

    def error(self, status: int, code: str, message: str, path: str) -> None:
        """An answer in S3's XML error format."""
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{escape(message)}</Message>"
            f"<Resource>/{escape(path)}</Resource><RequestId>fault-proxy</RequestId></Error>"
        ).encode()
        self.send_response_only(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
