"""A ``vllm serve`` child process: a free local port, its ``/health`` answer, and a stop that always ends it.

The server runs in its own process group (``start_new_session=True``), so stopping it ends its engine cores too.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    """Whether the server at ``url`` (``http://127.0.0.1:PORT``) answers ``/health`` with 200."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def wait_healthy(port: int, process: subprocess.Popen, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not healthy(f"http://127.0.0.1:{port}"):
        if process.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"vllm serve not ready after {timeout_s:.0f} s:\n{log.read_text()[-4000:]}")
        time.sleep(1)


def stop(process: subprocess.Popen) -> None:
    """SIGTERM the server's process group, SIGKILL it after 60 s; returns once it has exited."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def router_command() -> str:
    """The ``vllm-router`` console script of this Python's environment (the ``router`` extra)."""
    return str(Path(sys.executable).with_name("vllm-router"))


def start_router(arguments: list[str], log: Path, timeout_s: float = 60.0) -> tuple[subprocess.Popen, str]:
    """``vllm-router ARGUMENTS`` on a free local port, in its own process group, once it answers ``/health``: the
    process and its URL (stop it with :func:`stop`)."""
    port = free_port()
    with open(log, "w") as out:
        process = subprocess.Popen([router_command(), "--host", "127.0.0.1", "--port", str(port), *arguments],
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while not healthy(url):
        if process.poll() is not None or time.monotonic() > deadline:
            stop(process)
            raise RuntimeError(f"vllm-router did not start ({arguments}):\n{log.read_text()[-4000:]}")
        time.sleep(0.5)
    return process, url
