"""The built-in Python tool: the model's code runs in a fresh worker process per call, contained.

Each call gets an empty temporary folder (its working directory, removed afterwards) and a process that
- has its address space, CPU seconds, file sizes (its output included) and open files bounded by rlimits, and is
  killed with its whole process group when it outlives `timeout_s`;
- sits in a network namespace of its own where the kernel allows one (`unshare`): no interface but a down
  loopback, so no connection can leave;
- runs as the unprivileged `nobody` user when started as root (so the number of its processes is bounded by
  RLIMIT_NPROC, which root ignores, and no root-owned file is writable);
- runs under an audit hook (PEP 578, installed before the code is compiled, and no code can remove it) that
  refuses sockets, new processes (fork, exec, spawn, subprocess), ctypes, and writing, creating, renaming or
  removing files outside its folder.
The stdlib modules a calculation needs are imported before the user is dropped (the interpreter's own folder may
be unreadable to `nobody`); others may fail to import, which the model reads as an error.
Anything that fails (an exception, a limit, a kill) raises `PythonToolError` with the output's tail: the tool
environment turns it into the model's tool error message.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from drgrpo_jax.errors import PythonToolError

__all__ = ["PythonSandbox", "SandboxResult", "namespaces_available"]

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
NOBODY = 65534

_RUNNER = r'''
import os, resource, sys
for name in %(preload)r:
    try:
        __import__(name)
    except ImportError:
        pass
folder = os.path.realpath(os.getcwd())
if os.getuid() == 0:  # drop root: the folder was chowned to this user
    os.setgroups([])
    os.setgid(%(nobody)d)
    os.setuid(%(nobody)d)
resource.setrlimit(resource.RLIMIT_NPROC, (%(nproc)d, %(nproc)d))

def inside(path):
    if isinstance(path, int):
        return True  # an already open descriptor (stdout, stderr)
    try:
        path = os.fsdecode(path)
    except TypeError:
        return False
    full = os.path.realpath(os.path.join(folder, path))
    return full == folder or full.startswith(folder + os.sep)

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
REFUSED = ("socket.", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
           "subprocess.", "os.kill", "os.killpg", "pty.", "ctypes.", "os.startfile", "signal.pthread_kill",
           "winreg.", "_winapi.", "os.setuid", "os.setgid")
PATH_EVENTS = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.chmod", "os.chown", "os.symlink",
               "os.link", "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move",
               "os.listxattr", "os.setxattr", "os.removexattr"}

def hook(event, args):
    if event.startswith(REFUSED):
        raise PermissionError(f"the sandbox refuses {event}")
    if event == "import" and args and str(args[0]).split(".")[0] in ("ctypes", "_ctypes"):
        raise PermissionError("the sandbox refuses ctypes")
    if event == "open" and len(args) >= 3:
        path, mode, flags = args[:3]
        writes = (mode is not None and any(c in str(mode) for c in "wax+")) or \
                 (mode is None and isinstance(flags, int) and flags & WRITE_FLAGS)
        if writes and not inside(path):
            raise PermissionError(f"the sandbox refuses writing outside its folder: {path!r}")
    elif event in PATH_EVENTS:
        for path in args:
            if isinstance(path, (str, bytes, os.PathLike)) and not inside(path):
                raise PermissionError(f"the sandbox refuses {event} outside its folder: {path!r}")

sys.addaudithook(hook)
del hook
with open("snippet.py", encoding="utf-8") as f:
    source = f.read()
exec(compile(source, "snippet.py", "exec"), {"__name__": "__main__"})
'''

# Imported before the user is dropped: what a calculation needs, and socket and subprocess so that the audit hook,
# not a missing module, is what refuses their use.
PRELOAD = ("socket", "subprocess", "math", "cmath", "fractions", "decimal", "statistics", "random", "itertools",
           "functools", "collections",
           "json", "re", "string", "datetime", "heapq", "bisect", "operator", "numbers", "textwrap", "unicodedata",
           "encodings.idna", "traceback", "linecache", "tokenize")


def _unshare(flags: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.unshare(ctypes.c_int(flags)) == 0


def _network_namespace() -> bool:
    """Enters a new network namespace (as root, or as a user through a user namespace); whether it worked."""
    return _unshare(CLONE_NEWNET) or (os.getuid() != 0 and _unshare(CLONE_NEWUSER | CLONE_NEWNET))


def namespaces_available() -> bool:
    """Whether a child process can enter its own network namespace here."""
    try:
        done = subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], preexec_fn=_require_namespace,
                              capture_output=True, timeout=30)
    except (subprocess.SubprocessError, OSError):
        return False
    return done.returncode == 0


def _require_namespace() -> None:
    if not _network_namespace():
        raise OSError("unshare refused")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    output: str  # stdout and stderr together, at most max_output_bytes
    returncode: int | None  # None: killed at the time limit
    seconds: float
    namespaced: bool  # whether it ran in its own network namespace
    output_cut: bool  # it wrote more than max_output_bytes (Python ignores SIGXFSZ: the write fails with EFBIG)


@dataclasses.dataclass(frozen=True)
class PythonSandbox:
    """Runs code with the limits above. `namespaces`: True requires a network namespace (the worker fails to
    start where the kernel refuses one), False does without, None uses one where it can."""

    timeout_s: float = 10.0
    memory_mb: int = 512
    max_output_bytes: int = 8192
    max_processes: int = 8  # RLIMIT_NPROC of the dropped user (its processes machine-wide)
    max_open_files: int = 64
    namespaces: bool | None = None

    def __post_init__(self):
        for name in ("timeout_s", "memory_mb", "max_output_bytes", "max_processes", "max_open_files"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PythonSandbox.{name}: must be > 0, got {getattr(self, name)}")

    def _limits(self):
        memory = self.memory_mb * 2**20
        cpu = int(self.timeout_s) + 1
        files = self.max_output_bytes + 1  # one byte over the output limit raises SIGXFSZ

        def preexec() -> None:
            os.setsid()  # its own process group: the timeout kills the group
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
            resource.setrlimit(resource.RLIMIT_FSIZE, (files, files))
            resource.setrlimit(resource.RLIMIT_NOFILE, (self.max_open_files, self.max_open_files))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            if self.namespaces is not False:
                if not _network_namespace() and self.namespaces:
                    raise OSError("PythonSandbox.namespaces: the kernel refuses a network namespace")

        return preexec

    def run(self, code: str) -> SandboxResult:
        """Runs `code` in a fresh worker; the result whatever the code did (PythonSandbox.call raises instead)."""
        root = tempfile.mkdtemp(prefix="drgrpo-python-")
        try:
            folder = os.path.join(root, "work")
            os.mkdir(folder)
            with open(os.path.join(folder, "snippet.py"), "w", encoding="utf-8") as f:
                f.write(code)
            if os.getuid() == 0:  # the code runs as nobody, in a folder of its own
                for path in (folder, os.path.join(folder, "snippet.py")):
                    os.chown(path, NOBODY, NOBODY)
                os.chmod(root, 0o711)
            runner = _RUNNER % {"preload": PRELOAD, "nobody": NOBODY, "nproc": self.max_processes}
            output_path = os.path.join(root, "output")
            namespaced = self.namespaces is not False and (self.namespaces or namespaces_cached())
            start = time.monotonic()
            with open(output_path, "wb") as output:
                process = subprocess.Popen([sys.executable, "-I", "-S", "-c", runner], cwd=folder,
                                           stdin=subprocess.DEVNULL, stdout=output, stderr=output,
                                           env={"PYTHONIOENCODING": "utf-8", "PATH": "/usr/bin:/bin"},
                                           preexec_fn=self._limits(), close_fds=True)
                try:
                    returncode: int | None = process.wait(timeout=self.timeout_s)
                except subprocess.TimeoutExpired:
                    _kill_group(process)
                    returncode = None
            seconds = time.monotonic() - start
            with open(output_path, "rb") as f:
                raw = f.read(self.max_output_bytes + 1)
            text = raw[:self.max_output_bytes].decode("utf-8", errors="replace")
            return SandboxResult(text, returncode, seconds, bool(namespaced), len(raw) > self.max_output_bytes)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def call(self, code: str) -> str:
        """The code's output; PythonToolError (with the output's tail) when it failed or hit a limit."""
        result = self.run(code)
        if result.returncode == 0:
            return result.output
        tail = result.output[-1500:]
        if result.returncode is None:
            reason = f"timed out after {self.timeout_s:g} s"
        elif result.output_cut:
            reason = f"output beyond {self.max_output_bytes} bytes"
        elif result.returncode == -signal.SIGXCPU:
            reason = f"CPU time beyond {int(self.timeout_s) + 1} s"
        elif "MemoryError" in tail:
            reason = f"memory beyond {self.memory_mb} MB"
        elif result.returncode < 0:
            reason = f"killed by signal {signal.Signals(-result.returncode).name}"
        else:
            reason = f"exit status {result.returncode}"
        raise PythonToolError(f"{reason}\n{tail}".strip())

    def tool_function(self):
        """The function the model calls (`make_tool(sandbox.tool_function())`)."""

        def python(code: str) -> str:
            """Run Python code and return what it prints (stdout and stderr). Each call starts afresh, without
            network, in an empty folder; print the values you need."""
            return self.call(code)

        return python


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


_NAMESPACES: list[bool] = []


def namespaces_cached() -> bool:
    """namespaces_available(), asked once per process."""
    if not _NAMESPACES:
        _NAMESPACES.append(namespaces_available())
    return _NAMESPACES[0]
