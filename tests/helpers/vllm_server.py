"""``vllm serve`` in a child process for tests: started, waited for, and stopped whatever happens.

Each server runs in its own session (its own process group) on 127.0.0.1 and writes everything it logs to a
file the test can read (vLLM logs its engine cores' lines there too, prefixed with their process names).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from qeff_evs.bench.server_process import free_port, healthy, stop

START_TIMEOUT_S = 300


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    log: Path
    process: subprocess.Popen

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def vllm_command() -> str:
    return str(Path(sys.executable).with_name("vllm"))


@contextmanager
def vllm_servers(specs: Sequence[tuple[list[str], dict[str, str], Path, Path | None]],
                 ports: Sequence[int | None] | None = None) -> Iterator[list[Server]]:
    """Start one ``vllm serve`` per ``(arguments after 'vllm serve', extra environment, log file, cwd)``, all at
    once (each on its port of ``ports``, else a free one), wait until every one answers ``/health``, yield them, and
    stop them all at the end."""
    with ExitStack() as stack:
        servers = []
        for n, (arguments, env, log, cwd) in enumerate(specs):
            port = ports[n] if ports and ports[n] else free_port()
            out = stack.enter_context(open(log, "w"))
            argv = [vllm_command(), "serve", *arguments, "--host", "127.0.0.1", "--port", str(port)]
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, **env),
                                       cwd=cwd, start_new_session=True)
            stack.callback(stop, process)
            servers.append(Server(f"http://127.0.0.1:{port}", log, process))
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = list(servers)
        while waiting:
            for server in list(waiting):
                if server.process.poll() is not None:
                    pytest.fail(f"vllm serve exited with {server.process.returncode}:\n{server.log_text()[-5000:]}")
                if healthy(server.url):
                    waiting.remove(server)
            if waiting and time.monotonic() > deadline:
                pytest.fail(f"vllm serve not ready after {START_TIMEOUT_S} s:\n{waiting[0].log_text()[-5000:]}")
            time.sleep(1)
        yield servers


def openai_client(url: str, timeout: float):
    """An ``openai`` client for a test server that never retries and never reuses an idle connection.

    Without retries a dropped request fails the test instead of hiding. Keep-alive is off ("Connection: close")
    because the client's pool and vLLM's uvicorn both let an idle connection live 5 s: a request sent on one
    at that instant meets the server's close and fails with "Server disconnected without sending a response",
    a race of the test's client, not of the server (a vLLM user's client retries it).
    """
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=timeout, max_retries=0,
                         default_headers={"Connection": "close"})
