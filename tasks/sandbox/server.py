"""The sandbox as an HTTP service, its command line, and the lifecycle object that runs it.

The HTTP application itself (routes, admission control, counters) is in app.py.

    python -m tasks.sandbox.server serve --port 8123 --workers 4
"""

import argparse
import asyncio
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import fields
from pathlib import Path

from aiohttp import web

from tasks.sandbox.app import TOKEN_ENV, create_app
from tasks.sandbox.limits import Limits

# The directory that holds the `tasks` package, so `python -m tasks.sandbox.server` resolves
# whether or not the project is installed.
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


async def _watch_parent(app: web.Application) -> None:
    """Stop (as on SIGTERM: cells and template closed) once our parent is gone: a pipeline
    killed with SIGKILL cannot stop the service it started, and an orphan would hold its port."""
    parent = os.getppid()

    async def watch() -> None:
        while os.getppid() == parent:
            await asyncio.sleep(1.0)
        print("sandbox: the process that started it is gone; stopping", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    app["parent_watch"] = asyncio.get_running_loop().create_task(watch())


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _limit_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rstar2-sandbox", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the sandbox HTTP service")
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    serve.add_argument("--port", type=int, default=8123)
    serve.add_argument("--workers", type=int, default=4, help="programs running at once")
    serve.add_argument("--max-queue", type=int, default=4096, help="calls that may wait for a worker; more get 503")
    serve.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop when the process that started this one dies (even by SIGKILL)",
    )
    serve.add_argument(
        "--spawn",
        action="store_true",
        help="start a fresh interpreter per call instead of forking from a warm template",
    )
    # One flag per Limits field, so SandboxService can forward every limit it was given.
    for f in fields(Limits):
        serve.add_argument(_limit_flag(f.name), type=type(f.default), default=f.default, help=f.metadata["help"])
    args = parser.parse_args(argv)
    token = os.environ.get(TOKEN_ENV) or None
    if token is None and not _loopback(args.host):
        parser.error(
            f"--host {args.host}: a sandbox on a network address runs whatever anyone who reaches it "
            f"sends; set ${TOKEN_ENV} to the credential its callers send"
        )

    limits = Limits(**{f.name: getattr(args, f.name) for f in fields(Limits)})
    app = create_app(args.workers, args.max_queue, limits, template=not args.spawn, token=token)
    if args.exit_with_parent:
        app.on_startup.append(_watch_parent)
    print(
        f"sandbox on http://{args.host}:{args.port}: {args.workers} workers, queue {args.max_queue}, {limits}, "
        f"{'credential required' if token else 'no credential'}",
        file=sys.stderr,
        flush=True,
    )
    # A short shutdown grace: on SIGTERM, calls still running are cancelled, which kills their
    # process groups, rather than holding the stop for up to a full queue of work.
    web.run_app(app, host=args.host, port=args.port, access_log=None, print=None, shutdown_timeout=2.0)


# ------------------------------------------------------------------------------------------------
# Lifecycle object: the flows and the tests start the service through this.


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


# No proxy: an http_proxy set in the environment must not intercept calls to our own server.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class SandboxService:
    """Runs `python -m tasks.sandbox.server serve` as a child process; a context manager.

    The server's output goes to `log_path` (kept), or to a temporary file removed at stop().
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        workers: int = 4,
        limits: Limits = Limits(),
        max_queue: int = 4096,
        startup_timeout_s: float = 30.0,
        log_path: Path | None = None,
        token: str | None = None,
    ) -> None:
        """`token`: the credential every call must carry, handed to the server in its environment
        (never on its command line, which `ps` shows); None: none needed, on loopback only."""
        self.host = host
        self.port = port
        self.workers = workers
        self.limits = limits
        self.max_queue = max_queue
        self.startup_timeout_s = startup_timeout_s
        self.log_path = log_path
        self.token = token
        self._remove_log = False
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("SandboxService has no port until start()")
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> "SandboxService":
        if self._process is not None:
            raise RuntimeError(f"SandboxService already running at {self.url}")
        if self.port is None:
            self.port = _free_port(self.host)
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="rstar2-sandbox-server-", suffix=".log")
            os.close(fd)
            self.log_path, self._remove_log = Path(name), True
        argv = [
            sys.executable,
            "-m",
            "tasks.sandbox.server",
            "serve",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--workers",
            str(self.workers),
            "--max-queue",
            str(self.max_queue),
            "--exit-with-parent",
        ]
        for f in fields(Limits):
            argv += [_limit_flag(f.name), str(getattr(self.limits, f.name))]
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=_PACKAGE_ROOT,
                env={**os.environ, "OMP_NUM_THREADS": "1", TOKEN_ENV: self.token or ""},
                start_new_session=True,  # a Ctrl-C meant for the caller should not hit the server
            )
        self._wait_until_healthy()
        return self

    def _wait_until_healthy(self) -> None:
        assert self._process is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            returncode = self._process.poll()
            if returncode is not None:
                log = self._log_tail()
                self.stop()
                raise RuntimeError(
                    f"sandbox server exited with code {returncode} before answering "
                    f"{self.url}/health; its output:\n{log}"
                )
            try:
                with _DIRECT.open(self.url + "/health", timeout=1.0) as response:
                    if json.load(response).get("pid") == self._process.pid:
                        return
            except (OSError, ValueError):
                pass  # not listening yet, or not our server
            if time.monotonic() > deadline:
                log = self._log_tail()
                self.stop()
                raise RuntimeError(
                    f"sandbox server did not answer {self.url}/health within "
                    f"{self.startup_timeout_s:.0f} s; its output:\n{log}"
                )
            time.sleep(0.1)

    def _log_tail(self, n_bytes: int = 4000) -> str:
        assert self.log_path is not None
        data = self.log_path.read_bytes()
        return data[-n_bytes:].decode("utf-8", errors="replace")

    def stop(self, timeout_s: float = 10.0) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._remove_log and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
            self.log_path, self._remove_log = None, False

    def __enter__(self) -> "SandboxService":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


if __name__ == "__main__":
    main()
