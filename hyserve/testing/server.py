"""Servers and processes in tests: uvicorn over the app in a daemon thread of this process (``ServerThread``), a
free port, ``hyserve serve`` in a process of its own (``serve_subprocess``) and waiting for one to answer /health,
and checks that processes are gone."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import httpx
import openai
import uvicorn
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from hyserve.server import AsyncEngine, build_app


class ServerThread:
    """uvicorn on a free port of 127.0.0.1, in a daemon thread: a plain ``uvicorn.Server`` over ``build_app``, or
    the app and server that ``app`` / ``make_server`` give (the CLI's server, say)."""

    def __init__(self, async_engine: AsyncEngine, served_model_name: str | None = None, *,
                 app: FastAPI | None = None, make_server: Callable[[FastAPI], uvicorn.Server] | None = None) -> None:
        self.async_engine = async_engine
        self.app = app if app is not None else build_app(async_engine, served_model_name)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = make_server(self.app) if make_server is not None else \
            uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive(), "uvicorn exited during startup"
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=60)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as exposed, keyed ``name`` or ``name{k="v",...}`` (labels sorted)."""
        r = httpx.get(self.url + "/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        # It parses as Prometheus text (prometheus_client's parser would rename counter samples to ``*_total``,
        # the OpenMetrics convention, so the samples are read from the text as exposed).
        assert list(text_string_to_metric_families(r.text))
        out: dict[str, float] = {}
        for line in r.text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    def settle(self) -> None:
        assert self.async_engine.wait_until_idle(10), "the engine did not become idle"
        self.async_engine.assert_no_leaks()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_up(proc: subprocess.Popen[str], url: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("hyserve serve did not come up")


@contextmanager
def serve_subprocess(model: str, *flags: str, env: dict[str, str] | None = None
                     ) -> Iterator[tuple[str, subprocess.Popen[str], IO[str]]]:
    """``hyserve serve MODEL --device cpu --port P FLAGS`` in a process of its own, its output in a temporary file
    (nobody has to drain it while the tests run), with ``env`` over the environment less any ``VLLM_*`` variable:
    ``(url, process, log)`` once it answers /health; terminated (killed if it will not stop) on exit."""
    port = free_port()
    full = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    full.update({"OMP_NUM_THREADS": "1", **(env or {})})
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "hyserve.cli", "serve", model, "--device", "cpu", "--port",
                                 str(port), *flags], stdout=log, stderr=subprocess.STDOUT, text=True, env=full)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_up(proc, url)
            yield url, proc, log
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def process_gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie child of this process counts as gone once reaped
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        time.sleep(0.1)
    return False


def child_pids(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out
