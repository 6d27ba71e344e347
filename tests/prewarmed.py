"""A Python process with the service's libraries already imported, which starts `kevlaya` commands by forking.

An API or a worker that a test starts would otherwise spend seconds of CPU importing torch, transformers, peft,
Celery and FastAPI before it runs a line of its own; the suite starts about two hundred of them, and on a 2-core
machine that was most of its time (results README: the test suite's wall time). A forked child runs the same
command line (`cli.main.main` with its argv) in a session of its own, with its own environment, working directory
and log. Only third-party libraries are imported beforehand: the project's modules read their settings when they
are imported, and each child has its own.

Requests and answers are pickles on the server's stdin and stdout: ("start", argv, env, cwd, log path) -> pid, and
("poll", pid) -> None while it runs, else its exit status as `subprocess.Popen.returncode` gives it.
"""

from __future__ import annotations

import importlib
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

# What an API and a worker import before their first line of our code runs, by cost.
LIBRARIES = (
    "torch", "transformers", "transformers.models.auto.modeling_auto", "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.llama.modeling_llama", "peft", "peft.tuners.lora", "safetensors.torch", "tokenizers",
    "llguidance", "llguidance.torch",
    "celery", "celery.bin.celery", "celery.worker", "celery.apps.worker", "billiard.pool", "kombu.transport.redis",
    "redis", "fastapi", "starlette.applications", "uvicorn", "uvicorn.main", "httptools", "sqlalchemy",
    "sqlalchemy.orm", "sqlalchemy.dialects.sqlite", "psycopg", "alembic", "pydantic", "pydantic_settings", "typer",
    "prometheus_client", "tenacity", "httpx",
)


def _exit_status(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _run_child(argv: list[str], env: dict[str, str], cwd: str, log_path: str) -> None:
    """In the forked child: become the command, then leave with its exit code (never return to the server)."""
    code = 1
    try:
        os.setsid()
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = list(argv)
        from cli.main import main

        main()
        code = 0
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def serve() -> None:
    for name in LIBRARIES:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional library this machine lacks; the child imports what it needs itself
            pass
    requests, answers = sys.stdin.buffer, sys.stdout.buffer
    statuses: dict[int, int] = {}

    def answer(value: Any) -> None:
        pickle.dump(value, answers)
        answers.flush()

    answer("ready")
    while True:
        try:
            request = pickle.load(requests)
        except EOFError:
            return
        if request[0] == "start":
            pid = os.fork()
            if pid == 0:
                _run_child(*request[1:])
            answer(pid)
        elif request[0] == "poll":
            pid = request[1]
            if pid not in statuses:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    statuses[pid] = _exit_status(status)
            answer(statuses.get(pid))


class Prewarmed:
    """The test side: one server per test process, started once."""

    def __init__(self) -> None:
        self.server = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.lock = threading.Lock()
        if self._receive() != "ready":
            raise RuntimeError("the prewarmed server did not start")

    def _receive(self) -> Any:
        return pickle.load(self.server.stdout)

    def ask(self, *request: Any) -> Any:
        with self.lock:
            pickle.dump(request, self.server.stdin)
            self.server.stdin.flush()
            return self._receive()

    def start(self, argv: list[str], env: dict[str, str], cwd: Path, log_path: Path) -> ForkedProcess:
        return ForkedProcess(self, self.ask("start", argv, env, str(cwd), str(log_path)))

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(30)


class ForkedProcess:
    """The part of `subprocess.Popen` that tests use, for a process the server forked (its parent is the server,
    which reaps it and reports its exit status)."""

    def __init__(self, server: Prewarmed, pid: int) -> None:
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.ask("poll", self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    sys.path[0] = str(Path(sys.executable).parent)  # as the `kevlaya` script has it, not this folder
    serve()
