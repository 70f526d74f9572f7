"""A fault-injecting HTTP proxy for hub tests: sits in front of the mirror, logs bytes, breaks responses on demand.

    proxy = FaultProxy("http://127.0.0.1:8090").start()    # listens on a free 127.0.0.1 port
    proxy.inject("drop", times=2, match="/resolve/")        # the next 2 matching GETs die mid-body
    ... HF_ENDPOINT=proxy.url ...
    proxy.body_bytes(), proxy.log                           # what went to clients
    proxy.stop()

Faults (each hits the next ``times`` requests whose method is ``method`` and path contains ``match``):

- ``drop``: announce the full Content-Length, send half the body, close the connection.
- ``truncate``: a clean response whose Content-Length and body are only the first half.
- ``500`` / ``429``: that status with a short body (429 carries ``Retry-After: 0``).
- ``corrupt``: the full length, with bytes in the middle flipped (a checksum mismatch).

Upstream bodies are read whole before answering (the test files are a few MB), so the proxy can
set a Content-Length the upstream's chunked answers lack.

``ranges=True`` makes the proxy answer ``Range: bytes=N-`` GETs itself with 206 and the slice, as the
real hub's file servers do; olah 0.5.4 ignores Range (always 200 and the whole file), so without it
no download can resume.
"""

from __future__ import annotations

import http.client
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

FAULTS = ("drop", "truncate", "500", "429", "corrupt")
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection", "te", "upgrade"}


@dataclass
class Fault:
    kind: str
    times: int
    match: str = "/resolve/"
    method: str = "GET"


@dataclass
class Entry:
    method: str
    path: str
    status: int
    body_bytes: int
    range: str | None = None
    fault: str | None = None
    t: float = 0.0  # time.monotonic() when the answer was sent


@dataclass
class _State:
    faults: list[Fault] = field(default_factory=list)
    log: list[Entry] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _range_slice(wanted: str, status: int, headers: list, body: bytes) -> tuple[int, list, bytes]:
    """A 206 with the slice of ``body`` that the client's ``Range: bytes=N-[M]`` asks for."""
    start_s, _, end_s = wanted[len("bytes=") :].partition("-")
    start, end = int(start_s), int(end_s) if end_s else len(body) - 1
    total = len(body)
    body = body[start : end + 1]
    headers = [(k, v) for k, v in headers if k.lower() != "content-range"]
    headers.append(("Content-Range", f"bytes {start}-{start + len(body) - 1}/{total}"))
    return 206, headers, body


def _broken(kind: str | None, status: int, headers: list, body: bytes) -> tuple[int, list, bytes, int]:
    """The response as fault ``kind`` breaks it: (status, headers, body to send, Content-Length to announce)."""
    if kind in ("500", "429"):
        status, body = int(kind), f"injected {kind}\n".encode()
        headers = [("Content-Type", "text/plain")] + ([("Retry-After", "0")] if kind == "429" else [])
    announced = len(body)
    if kind == "truncate":
        body = body[: len(body) // 2]
        announced = len(body)
    elif kind == "corrupt" and body:
        mid = len(body) // 2
        body = body[:mid] + bytes(b ^ 0xFF for b in body[mid : mid + 16]) + body[mid + 16 :]
    elif kind == "drop":
        body = body[: len(body) // 2]
    return status, headers, body, announced


class _Handler(BaseHTTPRequestHandler):
    """Forwards one request upstream and answers it, broken as the proxy's next matching fault says."""

    protocol_version = "HTTP/1.1"
    proxy: FaultProxy  # set on the subclass each FaultProxy makes

    def log_message(self, *args: object) -> None:  # the test reads self.state.log instead
        pass

    def _fault(self) -> Fault | None:
        state = self.proxy.state
        with state.lock:
            for f in state.faults:
                if f.times > 0 and f.method == self.command and f.match in self.path:
                    f.times -= 1
                    return f
        return None

    def _fetch(self) -> tuple[int, list, bytes]:
        """The upstream's whole answer to this request: status, headers, body."""
        up = self.proxy.upstream
        length = int(self.headers.get("Content-Length") or 0)
        req_body = self.rfile.read(length) if length else None
        skip = _HOP | {"host"} | ({"range"} if self.proxy.ranges else set())
        headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
        conn = http.client.HTTPConnection(up.hostname, up.port, timeout=60)
        try:
            conn.request(self.command, self.path, body=req_body, headers=headers)
            resp = conn.getresponse()
            body = resp.read()
            return resp.status, resp.getheaders(), body
        finally:
            conn.close()

    def _send(self, status: int, headers: list, body: bytes, announced: int, kind: str | None) -> int:
        """Write the response; returns the body bytes sent."""
        self.send_response(status)
        for k, v in headers:
            if k.lower() not in _HOP:
                self.send_header(k, v)
        if self.command == "HEAD":
            self.send_header("Content-Length", dict((k.lower(), v) for k, v in headers).get("content-length", "0"))
            sent = 0
        else:
            self.send_header("Content-Length", str(announced))
            sent = len(body)
        if kind == "drop":
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
            self.wfile.flush()
        if kind == "drop":
            self.close_connection = True
        return sent

    def _forward(self) -> None:
        status, headers, body = self._fetch()
        wanted = self.headers.get("Range", "")
        if self.proxy.ranges and self.command == "GET" and status == 200 and wanted.startswith("bytes="):
            status, headers, body = _range_slice(wanted, status, headers, body)
        fault = self._fault()
        kind = fault.kind if fault else None
        status, headers, body, announced = _broken(kind, status, headers, body)
        sent = self._send(status, headers, body, announced, kind)
        state = self.proxy.state
        with state.lock:
            state.log.append(
                Entry(self.command, self.path, status, sent, self.headers.get("Range"), kind, time.monotonic())
            )

    do_GET = do_HEAD = do_POST = _forward


class FaultProxy:
    """Forward every request to ``upstream``; inject faults; log status and body bytes sent."""

    def __init__(self, upstream: str, port: int = 0, ranges: bool = False) -> None:
        self.upstream = urlsplit(upstream)
        self.ranges = ranges
        self.state = _State()
        handler = type("Handler", (_Handler,), {"proxy": self})
        self.server = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def netloc(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log(self) -> list[Entry]:
        with self.state.lock:
            return list(self.state.log)

    def start(self) -> FaultProxy:
        self.thread = threading.Thread(target=self.server.serve_forever, name="faultproxy", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def inject(self, kind: str, times: int, match: str = "/resolve/", method: str = "GET") -> None:
        """Break the next ``times`` matching requests with fault ``kind``."""
        if kind not in FAULTS:
            raise ValueError(f"fault {kind!r}; allowed: {', '.join(FAULTS)}")
        with self.state.lock:
            self.state.faults.append(Fault(kind, times, match, method))

    def clear(self) -> None:
        """Drop pending faults and the log."""
        with self.state.lock:
            self.state.faults.clear()
            self.state.log.clear()

    def body_bytes(self) -> int:
        """Body bytes sent to clients since the last clear."""
        return sum(e.body_bytes for e in self.log)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
