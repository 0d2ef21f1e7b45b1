"""Running the app under uvicorn: in the foreground for `infer.py --serve`, or on a thread (`Background`) for the
tests and the benchmark, on a port the system chooses."""

from __future__ import annotations

import ipaddress
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI

START_SECONDS = 60.0  # the most a background server may take to answer (a loaded 2-core machine is slow)
SHUTDOWN_SECONDS = 5  # what a stopping server gives the requests still open before it closes them


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def exposure_warning(host: str, has_key: bool) -> str | None:
    """What to say when the server listens beyond this machine; None on loopback."""
    if is_loopback(host):
        return None
    guard = "requests need the API key" if has_key else "anyone who reaches it can use the models: pass --api-key"
    return f"serving on {host}, not only on this machine: {guard}"


def _config(app: FastAPI, host: str, port: int, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=log_level in ("info", "debug"),
                          timeout_graceful_shutdown=SHUTDOWN_SECONDS)


def url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on `host` and `port` (0: a free one, read back with getsockname); OSError where the
    address is taken or not this machine's."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def run(app: FastAPI, sock: socket.socket, log_level: str = "info") -> None:
    """Serve `app` on `sock` until Ctrl-C (uvicorn then closes the open requests and ends the app's lifespan, which
    stops the generation)."""
    host, port = sock.getsockname()[:2]
    uvicorn.Server(_config(app, host, port, log_level)).run(sockets=[sock])


class Background:
    """The app served on a thread of this process, on a free loopback port: `with Background(app) as server:` then
    `server.url`. Entering waits (at most START_SECONDS) until it answers; leaving stops it."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", log_level: str = "warning"):
        self.host = host
        self.server = uvicorn.Server(_config(app, host, 0, log_level))
        self.thread: threading.Thread | None = None
        self.url = ""

    def __enter__(self) -> Background:
        sock = bind(self.host, 0)
        self.url = url(self.host, sock.getsockname()[1])
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, name="server",
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + START_SECONDS
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server stopped while starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not start within {START_SECONDS:.0f} s")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(START_SECONDS)
