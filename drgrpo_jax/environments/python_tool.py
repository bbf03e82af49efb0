"""The built-in Python tool: the model's code runs in a fresh worker process per call, in a jail the kernel enforces.

`containment="jail"` (the default; the run config's `environment.python_sandbox`) runs each call's
`python -I -S` under bubblewrap, with a seccomp filter that libseccomp compiles:
- namespaces of its own (user, mount, pid, network, IPC, UTS, cgroup): the file system holds only the interpreter
  and the system's libraries, read-only, a private /dev without the host's /dev/shm, and its folder, a tmpfs of
  `folder_mb` (gone with the call), as the only writable path; no /proc, no /etc, no project files; no network
  interface; its uid is 65534 in a user namespace that grants it no capability outside, and it cannot make another;
- seccomp (installed by bwrap before the interpreter starts): no new processes (threads only), no socket, no
  signal, ptrace, pidfd or prlimit aimed at another process, no io_uring, mount, namespace, keyring, BPF or module
  calls; the runner adds a second filter refusing execve before it reads the code;
- rlimits on address space, CPU seconds, file size and open files, set by the runner before it reads the code; at
  `timeout_s` the worker's process group is killed, and with bwrap (the pid namespace's first process) goes every
  process inside it;
- its stdout and stderr are a pipe that the caller reads up to `max_output_bytes` and then closes: the output never
  touches the host's disk (a file there could be grown past RLIMIT_FSIZE by `fallocate`).
Where bwrap, user namespaces or libseccomp are missing, the jail refuses to start (`PythonSandboxUnavailable`).

`containment="weak"` is what runs without them, by name only: the rlimits, the process group kill, the `nobody`
user when started as root, a network namespace where the kernel allows one, and an audit hook (PEP 578) that refuses
the plain ways to open sockets, start processes and write outside the folder. Code can get past the hook (it runs
in the same interpreter), so the weak mode does not contain a hostile model; docs/security.md lists what escapes.

Anything that fails (an exception, a limit, a kill) raises `PythonToolError` with the output's tail: the tool
environment turns it into the model's tool error message.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import functools
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Literal

from drgrpo_jax.errors import PythonSandboxUnavailable, PythonToolError

__all__ = ["CONTAINMENTS", "PythonSandbox", "SandboxResult", "jail_problem", "namespaces_available"]

Containment = Literal["jail", "weak"]
CONTAINMENTS: tuple[Containment, ...] = ("jail", "weak")
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
CLONE_THREAD = 0x00010000
NOBODY = 65534
JAIL_FOLDER = "/work"  # the call's folder as the jailed code sees it

# The syscalls the jail refuses (EPERM) to any argument; clone without CLONE_THREAD, clone3 and prlimit64 on another
# process are refused by rules of their own (_seccomp_programs).
REFUSED_SYSCALLS = (
    "fork", "vfork",  # new processes
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",  # other processes' memory
    "kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo",  # signals
    "pidfd_open", "pidfd_send_signal", "pidfd_getfd",
    "socket", "socketpair",  # the network, and unix sockets to anything
    "io_uring_setup", "io_uring_enter", "io_uring_register",  # its operations are not seen by seccomp
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr",  # namespaces and mounts
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key", "init_module", "finit_module",
    "delete_module", "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff", "acct", "syslog",
    "quotactl", "name_to_handle_at", "open_by_handle_at",  # the kernel's own state
    "fallocate",  # blocks reserved past RLIMIT_FSIZE, which the kernel checks only when a file's size changes
)
# What the jail sees of the host, read-only: the system's programs and libraries (paths that are symlinks, as on
# merged-/usr systems, become the same symlinks); the interpreter's own prefix is added where it lies elsewhere.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")

_RUNNER = r'''
import os, resource, sys
for name, value in %(limits)r:
    resource.setrlimit(getattr(resource, name), (value, value))
for name in %(preload)r:
    try:
        __import__(name)
    except ImportError:
        pass
%(containment)s
with open("snippet.py", encoding="utf-8") as f:
    source = f.read()
exec(compile(source, "snippet.py", "exec"), {"__name__": "__main__"})
'''

# The jail's runner: once started, no execve (bwrap's filter must let bwrap start the interpreter).
_NO_EXEC = r'''
import ctypes
def no_exec(program):
    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    code = ctypes.create_string_buffer(program, len(program))
    libc = ctypes.CDLL(None, use_errno=True)
    # PR_SET_NO_NEW_PRIVS, then PR_SET_SECCOMP with SECCOMP_MODE_FILTER
    if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.byref(Program(len(program) // 8,
                                                                             ctypes.addressof(code))), 0, 0):
        raise SystemExit(f"the sandbox could not refuse execve (errno {ctypes.get_errno()})")
no_exec(%(program)r)
del no_exec, ctypes, sys.modules["ctypes"]
'''

# The weak mode's runner: drop root, bound the user's processes, and an audit hook whose state lives in a closure
# (not in globals the code could rebind). The code shares the interpreter with it: a second layer, not a boundary.
_WEAK = r'''
if os.getuid() == 0:  # drop root: the folder was chowned to this user
    os.setgroups([])
    os.setgid(%(nobody)d)
    os.setuid(%(nobody)d)
resource.setrlimit(resource.RLIMIT_NPROC, (%(nproc)d, %(nproc)d))

def install_hook(folder=os.path.realpath(os.getcwd()), realpath=os.path.realpath, join=os.path.join,
                 fsdecode=os.fsdecode, sep=os.sep, PermissionError=PermissionError, isinstance=isinstance,
                 str=str, any=any):
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    refused = ("socket.", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
               "subprocess.", "os.kill", "os.killpg", "pty.", "ctypes.", "os.startfile", "signal.pthread_kill",
               "winreg.", "_winapi.", "os.setuid", "os.setgid")
    path_events = frozenset({"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.chmod", "os.chown", "os.symlink",
                             "os.link", "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move",
                             "os.listxattr", "os.setxattr", "os.removexattr"})

    def inside(path):
        if isinstance(path, int):
            return True  # an already open descriptor (stdout, stderr)
        try:
            path = fsdecode(path)
        except TypeError:
            return False
        full = realpath(join(folder, path))
        return full == folder or full.startswith(folder + sep)

    def hook(event, args):
        if event.startswith(refused):
            raise PermissionError(f"the sandbox refuses {event}")
        if event == "import" and args and str(args[0]).split(".")[0] in ("ctypes", "_ctypes"):
            raise PermissionError("the sandbox refuses ctypes")
        if event == "open" and len(args) >= 3:
            path, mode, flags = args[:3]
            writes = (mode is not None and any(c in str(mode) for c in "wax+")) or \
                     (mode is None and isinstance(flags, int) and flags & write_flags)
            if writes and not inside(path):
                raise PermissionError(f"the sandbox refuses writing outside its folder: {path!r}")
        elif event in path_events:
            for path in args:
                if isinstance(path, (str, bytes, os.PathLike)) and not inside(path):
                    raise PermissionError(f"the sandbox refuses {event} outside its folder: {path!r}")

    sys.addaudithook(hook)

install_hook()
del install_hook
'''

# Imported before the code runs: what a calculation needs (the weak mode drops root after this, and the
# interpreter's own folder may be unreadable to `nobody`), and socket and subprocess so that the sandbox, not a
# missing module, is what refuses their use.
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
    """Whether a child process can enter its own network namespace here (the weak mode's namespace)."""
    try:
        done = subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], preexec_fn=_require_namespace,
                              capture_output=True, timeout=30)
    except (subprocess.SubprocessError, OSError):
        return False
    return done.returncode == 0


def _require_namespace() -> None:
    if not _network_namespace():
        raise OSError("unshare refused")


def _bpf(seccomp_filter) -> bytes:
    with tempfile.TemporaryFile() as out:
        seccomp_filter.export_bpf(out)
        out.seek(0)
        return out.read()


@functools.cache
def _seccomp_programs() -> tuple[bytes, bytes]:
    """(the jail's filter, which bwrap installs before the interpreter starts; the execve ban the runner installs
    once started), as the BPF programs libseccomp compiles for this machine."""
    import pyseccomp as seccomp  # Linux only: it loads libseccomp.so when imported

    refuse = seccomp.ERRNO(errno.EPERM)
    jail, no_exec = seccomp.SyscallFilter(seccomp.ALLOW), seccomp.SyscallFilter(seccomp.ALLOW)
    for program in (jail, no_exec):
        program.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.KILL_PROCESS)  # another ABI's numbers mean other calls
    for name in REFUSED_SYSCALLS:
        jail.add_rule(refuse, name)
    jail.add_rule(refuse, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_THREAD, 0))  # a process, not a thread
    jail.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")  # its flags lie out of the filter's reach: glibc then clones
    jail.add_rule(refuse, "prlimit64", seccomp.Arg(0, seccomp.NE, 0))  # pid 0 is the caller itself
    for name in ("execve", "execveat"):
        no_exec.add_rule(refuse, name)
    return _bpf(jail), _bpf(no_exec)


def _read_only_binds() -> list[str]:
    """bwrap's arguments for the system's libraries and this interpreter, read-only."""
    args: list[str] = []
    for path in SYSTEM_PATHS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for prefix in sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)}):
        if not any(prefix == p or prefix.startswith(p + "/") for p in SYSTEM_PATHS):
            args += ["--ro-bind", prefix, prefix]
    return args


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    output: str  # stdout and stderr together, at most max_output_bytes
    returncode: int | None  # None: killed at the time limit
    seconds: float
    namespaced: bool  # whether it ran in its own network namespace (always, in the jail)
    output_cut: bool  # it wrote more than max_output_bytes (the pipe is then closed: its next write fails, EPIPE)


@dataclasses.dataclass(frozen=True)
class PythonSandbox:
    """Runs code contained as the module says. `containment`: "jail" (refuses to run where it cannot start) or
    "weak". `folder_mb`: the jail's writable folder (a tmpfs). `max_processes` and `namespaces` are the weak mode's:
    RLIMIT_NPROC of the dropped user, and True to require a network namespace, False to do without, None to use
    one where the kernel allows."""

    timeout_s: float = 10.0
    memory_mb: int = 512
    max_output_bytes: int = 8192
    max_processes: int = 8
    max_open_files: int = 64
    folder_mb: int = 16
    containment: Containment = "jail"
    namespaces: bool | None = None

    def __post_init__(self):
        for name in ("timeout_s", "memory_mb", "max_output_bytes", "max_processes", "max_open_files", "folder_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PythonSandbox.{name}: must be > 0, got {getattr(self, name)}")
        if self.containment not in CONTAINMENTS:
            raise ValueError(f"PythonSandbox.containment: one of {CONTAINMENTS}, got {self.containment!r}")

    def check(self) -> None:
        """Raises PythonSandboxUnavailable when the jail cannot start here (the weak mode always can)."""
        problem = self.containment == "jail" and jail_problem()
        if problem:
            raise PythonSandboxUnavailable(problem)

    def _limits(self) -> tuple[tuple[str, int], ...]:
        return (("RLIMIT_AS", self.memory_mb * 2**20), ("RLIMIT_CPU", int(self.timeout_s) + 1),
                ("RLIMIT_FSIZE", self.max_output_bytes + 1),  # each file it writes (the weak mode's are on disk)
                ("RLIMIT_NOFILE", self.max_open_files), ("RLIMIT_CORE", 0))

    def run(self, code: str) -> SandboxResult:
        """Runs `code` in a fresh worker; the result whatever the code did (PythonSandbox.call raises instead)."""
        self.check()
        return self._run_jail(code) if self.containment == "jail" else self._run_weak(code)

    def _run_jail(self, code: str) -> SandboxResult:
        jail_filter, no_exec = _seccomp_programs()
        runner = _RUNNER % {"limits": self._limits(), "preload": PRELOAD,
                            "containment": _NO_EXEC % {"program": no_exec}}
        seccomp_fd, code_fd = _memfd("seccomp", jail_filter), _memfd("snippet", code.encode("utf-8"))
        try:
            command = ["bwrap", "--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                       "--unshare-cgroup-try", "--disable-userns", "--uid", str(NOBODY), "--gid", str(NOBODY),
                       "--die-with-parent", "--new-session", *_read_only_binds(),
                       "--dev", "/dev", "--remount-ro", "/dev",
                       "--size", str(self.folder_mb * 2**20), "--tmpfs", JAIL_FOLDER,
                       "--file", str(code_fd), f"{JAIL_FOLDER}/snippet.py", "--chdir", JAIL_FOLDER,
                       "--remount-ro", "/", "--seccomp", str(seccomp_fd),
                       os.path.realpath(sys.executable), "-I", "-S", "-c", runner]
            env = {"PYTHONIOENCODING": "utf-8", "PATH": "/usr/bin:/bin", "TMPDIR": JAIL_FOLDER, "HOME": JAIL_FOLDER}
            return self._execute(command, env, None, (seccomp_fd, code_fd), namespaced=True)
        finally:
            os.close(seccomp_fd)
            os.close(code_fd)

    def _run_weak(self, code: str) -> SandboxResult:
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
            weak = _WEAK % {"nobody": NOBODY, "nproc": self.max_processes}
            runner = _RUNNER % {"limits": self._limits(), "preload": PRELOAD, "containment": weak}
            namespaced = self.namespaces is not False and (self.namespaces or namespaces_cached())
            command = [sys.executable, "-I", "-S", "-c", runner]
            env = {"PYTHONIOENCODING": "utf-8", "PATH": "/usr/bin:/bin"}
            return self._execute(command, env, folder, (), namespaced=bool(namespaced),
                                 preexec_fn=self._weak_namespace if namespaced else None)
        finally:
            _remove_tree(root)

    def _weak_namespace(self) -> None:
        if not _network_namespace() and self.namespaces:
            raise OSError("PythonSandbox.namespaces: the kernel refuses a network namespace")

    def _execute(self, command: list[str], env: dict[str, str], cwd: str | None, pass_fds: tuple[int, ...], *,
                 namespaced: bool, preexec_fn=None) -> SandboxResult:
        start = time.monotonic()
        deadline = start + self.timeout_s
        read_fd, write_fd = os.pipe()
        try:
            try:  # its own process group (and session): the timeout kills the group
                process = subprocess.Popen(command, cwd=cwd, stdin=subprocess.DEVNULL, stdout=write_fd,
                                           stderr=write_fd, env=env, close_fds=True, pass_fds=pass_fds,
                                           start_new_session=True, preexec_fn=preexec_fn)
            finally:
                os.close(write_fd)
            raw = _read_output(process, read_fd, self.max_output_bytes + 1, deadline)
        finally:
            os.close(read_fd)  # past the limit, the worker's next write fails (EPIPE) and it ends
        returncode = _wait(process, deadline)
        seconds = time.monotonic() - start
        text = raw[:self.max_output_bytes].decode("utf-8", errors="replace")
        return SandboxResult(text, returncode, seconds, namespaced, len(raw) > self.max_output_bytes)

    def call(self, code: str) -> str:
        """The code's output; PythonToolError (with the output's tail) when it failed or hit a limit."""
        result = self.run(code)
        if result.returncode == 0:
            return result.output
        tail = result.output[-1500:]
        killed_by = _killing_signal(result.returncode, jailed=self.containment == "jail")
        if result.returncode is None:
            reason = f"timed out after {self.timeout_s:g} s"
        elif result.output_cut:
            reason = f"output beyond {self.max_output_bytes} bytes"
        elif killed_by == signal.SIGXCPU:
            reason = f"CPU time beyond {int(self.timeout_s) + 1} s"
        elif "MemoryError" in tail:
            reason = f"memory beyond {self.memory_mb} MB"
        elif killed_by is not None:
            reason = f"killed by signal {killed_by.name}"
        else:
            reason = f"exit status {result.returncode}"
        raise PythonToolError(f"{reason}\n{tail}".strip())

    def tool_function(self):
        """The function the model calls (`make_tool(sandbox.tool_function())`); PythonSandboxUnavailable here
        already when the jail cannot start."""
        self.check()

        def python(code: str) -> str:
            """Run Python code and return what it prints (stdout and stderr). Each call starts afresh, without
            network, in an empty folder; print the values you need."""
            return self.call(code)

        return python


def _killing_signal(returncode: int | None, *, jailed: bool) -> signal.Signals | None:
    """The signal that ended the worker, if one did (bwrap reports its command's as exit status 128 + number)."""
    number = -returncode if returncode is not None and returncode < 0 else \
        returncode - 128 if jailed and returncode is not None and returncode > 128 else None
    return signal.Signals(number) if number in signal.valid_signals() else None


def _read_output(process: subprocess.Popen, read_fd: int, limit: int, deadline: float) -> bytes:
    """What the worker writes to its pipe, at most `limit` bytes: until the pipe closes, the deadline, or the worker
    has exited while something it left behind (the weak mode's children) holds the pipe open."""
    output = bytearray()
    poller = select.poll()
    poller.register(read_fd, select.POLLIN)
    while len(output) < limit and (remaining := deadline - time.monotonic()) > 0:
        if not poller.poll(min(remaining, 0.1) * 1000):
            if process.poll() is not None:
                break
            continue
        chunk = os.read(read_fd, limit - len(output))
        if not chunk:
            break
        output += chunk
    return bytes(output)


def _wait(process: subprocess.Popen, deadline: float) -> int | None:
    """The worker's exit status; None when it was still running at the deadline (its process group is killed)."""
    try:
        return process.wait(timeout=max(deadline - time.monotonic(), 0))
    except subprocess.TimeoutExpired:
        _kill_group(process)
        return None


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _remove_tree(root: str) -> None:
    """Removes the weak mode's folder, whatever the code left in it."""
    try:
        shutil.rmtree(root, ignore_errors=True)
    except RecursionError:  # nested deeper than Python recurses
        pass
    if os.path.lexists(root):  # folders made unreadable, or too deep: coreutils walk them without recursing
        subprocess.run(["chmod", "-R", "u+rwX", root], capture_output=True, check=False)
        subprocess.run(["rm", "-rf", root], capture_output=True, check=False)


@functools.cache
def jail_problem() -> str | None:
    """Why the jail cannot start here (None: it can); asked once per process."""
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (no bwrap on PATH; Debian/Ubuntu: apt-get install bubblewrap)"
    try:
        _seccomp_programs()
    except (ImportError, OSError, RuntimeError) as error:  # pyseccomp raises RuntimeError without libseccomp.so
        return f"libseccomp cannot compile the filter ({error}; pip install pyseccomp, apt-get install libseccomp2)"
    try:
        result = PythonSandbox(timeout_s=30)._run_jail("print('ok')")
    except OSError as error:
        return f"bwrap cannot start: {error}"
    if result.returncode != 0 or result.output != "ok\n":
        lines = result.output.strip().splitlines() or [f"exit status {result.returncode}"]
        return f"bwrap cannot start the jail here: {lines[-1]}"
    return None


namespaces_cached = functools.cache(namespaces_available)  # asked once per process, as jail_problem
