"""Runs a worker script as the two processes of a `jax.distributed` run on a free loopback port."""

import os
import pathlib
import socket
import subprocess
import sys

import numpy as np


def start_two_processes(script: str, out: pathlib.Path, *args: str) -> list[subprocess.Popen]:
    """`python tests/support/SCRIPT PROCESS_ID PORT OUT ARGS...` for process ids 0 and 1, on a free loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = [sys.executable, str(pathlib.Path(__file__).with_name(script))]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # each worker sets its own device count
    return [subprocess.Popen([*worker, str(i), str(port), str(out), *args], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for i in range(2)]


def run_two_processes(script: str, out: pathlib.Path, *args: str, timeout_s: float = 240) -> dict[str, np.ndarray]:
    """`python tests/support/SCRIPT PROCESS_ID PORT OUT.npz ARGS...` for process ids 0 and 1; what process 0 saved
    in OUT."""
    procs = start_two_processes(script, out, *args)
    try:
        outputs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)[-4000:]
    return dict(np.load(out))
