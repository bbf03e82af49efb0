"""`LocalServer`: the generation service (`python -m drgrpo_jax.serve`) as the trainer's child process."""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Self

import httpx

from drgrpo_jax.errors import RolloutError

__all__ = ["LocalServer"]


class LocalServer:
    """`python -m drgrpo_jax.serve` as a child process on a free loopback port (a context manager).

    Stopped on `stop()`, on leaving the `with` block (errors included) and at interpreter exit; the
    child also watches its parent and shuts down if the trainer dies without cleaning up (SIGKILL).
    """

    def __init__(self, model: str, *, dtype: str = "float32", weight_version: str | int = 0,
                 extra_args: Sequence[str] = (), startup_timeout_s: float = 600.0, log_path: str | None = None,
                 env: dict[str, str] | None = None, api_key_env: str = "", weights_roots: Sequence[str] = (),
                 mesh: str = ""):
        self.model, self.dtype, self.weight_version = os.fspath(model), dtype, str(weight_version)
        self.extra_args, self.startup_timeout_s = tuple(extra_args), startup_timeout_s
        self.log_path, self.env = log_path, env
        # The key travels in the child's environment under this name; only the name is on its command line.
        self.api_key_env, self.weights_roots = api_key_env, tuple(os.fspath(r) for r in weights_roots)
        self.mesh = mesh.strip()  # the child's --mesh (tensor=T[,data=D]); "" = one device
        self.url: str | None = None
        self.returncode: int | None = None  # the exit code of the last child, once it has exited
        self._process: subprocess.Popen | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None

    def start(self) -> str:
        """Starts the child and waits until /health answers; returns its URL."""
        self._tmp = self._tmp or tempfile.TemporaryDirectory(prefix="drgrpo_serve_")  # kept across restarts
        port_file = os.path.join(self._tmp.name, "port")
        if os.path.exists(port_file):  # the port of a previous child
            os.remove(port_file)
        self.log_path = self.log_path or os.path.join(self._tmp.name, "serve.log")
        command = [sys.executable, "-m", "drgrpo_jax.serve", "--model", self.model, "--dtype", self.dtype,
                   "--host", "127.0.0.1", "--port", "0", "--port-file", port_file,
                   "--weight-version", self.weight_version, "--parent-pid", str(os.getpid()),
                   *(["--api-key-env", self.api_key_env] if self.api_key_env else []),
                   *[arg for root in self.weights_roots for arg in ("--weights-root", root)],
                   *(["--mesh", self.mesh] if self.mesh else []), *self.extra_args]
        env = {**os.environ, **(self.env or {})}
        with open(self.log_path, "ab") as log_file:
            self._process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                             stdin=subprocess.DEVNULL)
        atexit.register(self.stop)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self._process.poll() is not None:
                raise RolloutError(f"generation service exited with code {self._process.returncode} while "
                                   f"starting; log {self.log_path}:\n{self.log_tail()}")
            if os.path.exists(port_file):
                with open(port_file) as f:
                    self.url = f"http://127.0.0.1:{int(f.read())}"
                try:
                    if httpx.get(self.url + "/health", timeout=5.0).status_code == 200:
                        return self.url
                except httpx.TransportError:
                    pass
            if time.monotonic() > deadline:
                self.stop()
                raise RolloutError(f"generation service not ready after {self.startup_timeout_s:.0f} s; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, num_chars: int = 3000) -> str:
        """The end of the child's log."""
        if self.log_path is None:
            return ""
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-num_chars:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM (graceful), then SIGKILL after timeout_s; returns the exit code. Idempotent."""
        process, self._process = self._process, None
        code = None
        if process is not None:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            code = process.returncode
        atexit.unregister(self.stop)
        return code

    @property
    def running(self) -> bool:
        """Whether the child process is alive."""
        if self._process is None:
            return False
        self.returncode = self._process.poll()
        return self.returncode is None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
