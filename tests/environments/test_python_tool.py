"""The Python tool's worker: its limits, its jail (escapes a model could write, run through ToolEnvironment.step, as
root and as an unprivileged trainer), and the weak mode a user opts into by name.

Run as a script (`python test_python_tool.py escapes PARAMS_JSON`), it runs the escapes and prints their results as
JSON: the unprivileged test starts it as uid 65534.
"""

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
import typing
import uuid

import pytest

from drgrpo_jax.config.schema import EnvironmentConfig
from drgrpo_jax.environments.build import build_tools
from drgrpo_jax.environments.python_tool import CONTAINMENTS, PythonSandbox, jail_problem, namespaces_available
from drgrpo_jax.environments.tool_env import ToolEnvironment
from drgrpo_jax.environments.tools import make_tool
from drgrpo_jax.errors import ConfigError, PythonSandboxUnavailable, PythonToolError

pytestmark = pytest.mark.subprocess  # every call starts a worker process

PROJECT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODES = ["jail", "weak", pytest.param("weak-namespace", marks=pytest.mark.skipif(
    not namespaces_available(), reason="this kernel refuses network namespaces"))]


# .ci/run installs bubblewrap and sets this: there the jail's tests never skip.
REQUIRE_JAIL = os.environ.get("DRGRPO_REQUIRE_JAIL") == "1"


def need_jail() -> None:
    """Skips a test of the jail on a machine where it cannot start, naming what is missing."""
    if not REQUIRE_JAIL and (problem := jail_problem()) is not None:
        pytest.skip(f"the Python tool's jail cannot start here: {problem}")


def make_sandbox(mode: str = "jail", **limits) -> PythonSandbox:
    if mode == "jail":
        need_jail()
        return PythonSandbox(**limits)
    return PythonSandbox(containment="weak", namespaces=mode == "weak-namespace", **limits)


@pytest.fixture(params=MODES)
def sandbox(request):
    return make_sandbox(request.param, timeout_s=4, memory_mb=256, max_output_bytes=4096)


def test_the_jail_starts_here():
    need_jail()
    assert jail_problem() is None


def test_runs_code_in_an_empty_folder_of_its_own(sandbox):
    assert sandbox.call("import os, math\nprint(sorted(os.listdir('.')), math.factorial(20))") == \
        "['snippet.py'] 2432902008176640000\n"
    assert sandbox.call("open('a.txt', 'w').write('hi')\nprint(open('a.txt').read())") == "hi\n"


def test_writes_outside_its_folder_are_refused(sandbox, tmp_path):
    target = tmp_path / "outside.txt"
    os.chmod(tmp_path, 0o777)  # writable by anyone: only the sandbox stops it
    for code in (f"open({str(target)!r}, 'w').write('x')", f"import os\nos.mkdir({str(tmp_path / 'd')!r})",
                 "open('../escape.txt', 'w').write('x')", "open('/tmp/drgrpo-escape.txt', 'a').write('x')"):
        with pytest.raises(PythonToolError, match="PermissionError|Read-only file system|No such file"):
            sandbox.call(code)
    assert not target.exists() and not (tmp_path / "d").exists() and not os.path.exists("/tmp/drgrpo-escape.txt")


def test_network_connections_are_refused(sandbox):
    with pytest.raises(PythonToolError, match="PermissionError"):
        sandbox.call("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)")


def test_the_weak_namespace_has_no_network_interface_but_loopback():
    if not namespaces_available():
        pytest.skip("this kernel refuses network namespaces")
    code = "print(sorted(line.split(':')[0].strip() for line in open('/proc/self/net/dev').readlines()[2:]))"
    assert make_sandbox("weak-namespace").call(code) == "['lo']\n"
    assert make_sandbox("weak").call(code) != "['lo']\n"  # the host's interfaces: the check can fail
    assert make_sandbox("weak-namespace").run("pass").namespaced


def test_fork_without_bound_is_contained(sandbox):
    start = time.monotonic()
    with pytest.raises(PythonToolError, match="PermissionError"):
        sandbox.call("import os\nwhile True:\n    os.fork()")
    with pytest.raises(PythonToolError, match="PermissionError"):
        sandbox.call("import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])")
    assert time.monotonic() - start < 30


def test_threads_run_in_the_jail():
    code = ("import threading\nout = []\nthreads = [threading.Thread(target=out.append, args=(i,)) for i in range(4)]\n"
            "[t.start() for t in threads]\n[t.join() for t in threads]\nprint(sorted(out))")
    assert make_sandbox().call(code) == "[0, 1, 2, 3]\n"


def test_allocation_without_bound_is_contained(sandbox):
    with pytest.raises(PythonToolError, match="memory beyond 256 MB"):
        sandbox.call("x = []\nwhile True:\n    x.append(bytearray(10**7))")


def test_time_and_output_limits(sandbox):
    start = time.monotonic()
    with pytest.raises(PythonToolError, match="timed out after 4 s|CPU time"):
        sandbox.call("while True:\n    pass")
    assert time.monotonic() - start < 15
    with pytest.raises(PythonToolError, match="output beyond 4096 bytes"):
        sandbox.call("print('x' * 100000)")


def test_the_output_is_a_pipe_not_a_file_on_the_hosts_disk(sandbox):
    assert sandbox.call("import os, stat\nprint([stat.S_ISFIFO(os.fstat(fd).st_mode) for fd in (1, 2)])") == \
        "[True, True]\n"


def test_fallocate_cannot_reserve_disk_past_the_output_limit():
    """Issue #64: ext4 checks RLIMIT_FSIZE only when a file's size changes, so fallocate with FALLOC_FL_KEEP_SIZE
    reserved 1 GiB of the host's disk through the worker's stdout (then a file)."""
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "libc.fallocate.argtypes = [ctypes.c_int] * 2 + [ctypes.c_long] * 2\n"
            "for fd in (1, os.open('f', os.O_CREAT | os.O_WRONLY)):\n"
            "    print(libc.fallocate(fd, 1, 0, 2**30), os.strerror(ctypes.get_errno()))")
    assert make_sandbox().call(code) == "-1 Operation not permitted\n" * 2


def test_the_jails_folder_is_bounded():
    code = "for i in range(1000):\n    with open(f'f{i}', 'w') as f:\n        f.write('x' * 4000)"
    with pytest.raises(PythonToolError, match="No space left on device"):
        make_sandbox(folder_mb=1).call(code)


def test_the_weak_mode_refuses_ctypes():
    with pytest.raises(PythonToolError, match="refuses ctypes"):
        make_sandbox("weak").call("import ctypes")


def test_a_killed_or_hanging_python_tool_is_a_tool_error_message():
    need_jail()
    env = ToolEnvironment([make_tool(PythonSandbox(timeout_s=2).tool_function())])
    env.reset({"prompt": "q"})
    observation = env.step(tool_calls(["import time\ntime.sleep(60)", "import ctypes\nctypes.string_at(0)",
                                       "import os, signal\nos.kill(os.getpid(), 9)", "print(6 * 7)"]))
    contents = [m["content"] for m in observation.messages]
    assert contents[0].startswith("error: PythonToolError: timed out after 2 s")
    assert contents[1].startswith("error: PythonToolError: killed by signal SIGSEGV")
    assert contents[2].startswith("error: PythonToolError") and "Operation not permitted" in contents[2]
    assert contents[3] == "42\n"
    assert (observation.tool_calls, observation.tool_errors) == (4, 3)


def test_without_bwrap_the_python_tool_refuses_to_start_naming_the_key(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    jail_problem.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"^environment\.python_sandbox: jail: bubblewrap is not installed .*"
                                              r"set environment\.python_sandbox=weak"):
            build_tools(EnvironmentConfig(tools=("python",)))
        with pytest.raises(PythonSandboxUnavailable, match="bubblewrap is not installed"):
            PythonSandbox().run("print(1)")
        weak, = build_tools(EnvironmentConfig(tools=("python",), python_sandbox="weak"))
        assert weak.fn(code="print(6 * 7)") == "42\n"
    finally:
        jail_problem.cache_clear()


def test_the_weak_mode_removes_what_the_code_left(world, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", world[0]["tmp"])
    make_sandbox("weak").call("import os\n" + ESCAPES["leave_an_unremovable_folder"])
    assert os.listdir(world[0]["tmp"]) == []


def test_the_config_offers_the_sandboxs_containments():
    assert typing.get_args(typing.get_type_hints(EnvironmentConfig)["python_sandbox"]) == CONTAINMENTS


# Escapes as a model would write them. Each begins by switching off the audit hook the way the issue found (the
# hook read the runner's globals), and prints ESCAPED when a step it must not take worked. {outside}: a folder
# anyone may write (holding keep.txt), {marker}: this test's name for what it leaves, {port}: a listener on
# 127.0.0.1, {trainer}: the pid of the process running the tool.
PRELUDE = '''import os, sys
m = sys.modules["__main__"]
m.REFUSED = ()
m.inside = lambda path: True
def attempt(what, step):
    try:
        result = step()
    except BaseException as error:
        print("refused", what, type(error).__name__, flush=True)
    else:
        print("ESCAPED", what, result, flush=True)
'''
ESCAPES = {
    "read_etc_passwd": "attempt('passwd', lambda: open('/etc/passwd').read())",
    "read_project_files": "attempt('project', lambda: open({project!r} + '/pyproject.toml').read())",
    "read_command_lines": "attempt('cmdlines', lambda: [open(f'/proc/{{p}}/cmdline', 'rb').read() "
                          "for p in os.listdir('/proc') if p.isdigit()])",
    "read_parent_environ": "attempt('environ', lambda: open(f'/proc/{{os.getppid()}}/environ', 'rb').read())\n"
                           "attempt('trainer environ', lambda: open('/proc/{trainer}/environ', 'rb').read())",
    "write_through_dir_fd": '''import stat
def opened(path):
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as error:
        print("refused open", type(error).__name__)
        return -1
folder, root = opened({outside!r}), opened("/")
attempt("create", lambda: os.write(os.open("created", os.O_CREAT | os.O_WRONLY, 0o666, dir_fd=folder), b"x"))
attempt("tmp", lambda: os.open("tmp/drgrpo-escape-{marker}", os.O_CREAT | os.O_WRONLY, 0o666, dir_fd=root))
attempt("mkfifo", lambda: os.mkfifo("fifo", dir_fd=folder))
attempt("mknod", lambda: os.mknod("node", 0o666 | stat.S_IFREG, dir_fd=folder))
attempt("mkdir", lambda: os.mkdir("made", dir_fd=folder))
attempt("overwrite", lambda: os.write(os.open("keep.txt", os.O_WRONLY | os.O_TRUNC, dir_fd=folder), b"gone"))
attempt("delete", lambda: os.unlink("keep.txt", dir_fd=folder))''',
    "write_after_chdir": '''attempt("create", lambda: (os.chdir({outside!r}), open("after-chdir", "w").write("x")))
attempt("mkfifo", lambda: (os.chdir({outside!r}), os.mkfifo("fifo-after-chdir")))
attempt("delete", lambda: (os.chdir({outside!r}), os.remove("keep.txt")))
attempt("tmp", lambda: (os.chdir("/tmp"), open("drgrpo-escape-{marker}", "w").write("x")))''',
    "connect_to_localhost": '''import socket
def connect():
    with socket.create_connection(("127.0.0.1", {port}), timeout=2) as s:
        s.sendall(b"{marker}")
attempt("connect", connect)''',
    "fork_exec_outliving_the_timeout": '''import _posixsubprocess, time
def start():
    read, write = os.pipe()
    args = [sys.executable, "-c", "import time; time.sleep(30)  # {marker}"]
    return _posixsubprocess.fork_exec(args, [os.fsencode(sys.executable)], True, (write,), None, None,
                                      -1, -1, -1, -1, -1, -1, read, write, True, True, -1, None, None, None, -1,
                                      None, False)
attempt("fork_exec", start)
time.sleep(60)''',
    "setsid_child_outliving_the_timeout": '''import time
def start():
    pid = os.fork()
    if pid == 0:
        os.setsid()
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(30)  # {marker}"])
    return pid
attempt("fork", start)
time.sleep(60)''',
    "signal_the_trainer": '''import signal
attempt("pidfd", lambda: signal.pidfd_send_signal(os.pidfd_open(os.getppid()), signal.SIGUSR1))
attempt("pidfd trainer", lambda: signal.pidfd_send_signal(os.pidfd_open({trainer}), signal.SIGUSR1))
attempt("kill", lambda: os.kill(os.getppid(), signal.SIGUSR2))
attempt("kill trainer", lambda: os.kill({trainer}, signal.SIGUSR2))''',
    "prlimit_another_process": '''import resource
for pid in (os.getppid(), {trainer}):
    def lower(pid=pid):
        hard = resource.prlimit(pid, resource.RLIMIT_CORE)[1]
        return resource.prlimit(pid, resource.RLIMIT_CORE, (12345, hard))
    attempt(f"prlimit {{pid}}", lower)''',
    "write_proc_mem": '''attempt("self", lambda: open("/proc/self/mem", "r+b").close())
attempt("parent", lambda: open(f"/proc/{{os.getppid()}}/mem", "r+b").close())''',
    "fill_dev_shm": '''def fill():
    with open("/dev/shm/drgrpo-escape-{marker}", "wb") as f:
        for _ in range(4):
            f.write(b"x" * 1000)
attempt("shm", fill)''',
    "leave_an_unremovable_folder": '''def locked():
    os.makedirs("locked/inner")
    open("locked/inner/file", "w").write("x")
    os.chmod("locked/inner", 0)
    os.chmod("locked", 0o100)
def deep():
    for _ in range(1500):
        os.mkdir("n")
        os.chdir("n")
    for _ in range(1500):
        os.chdir("..")
locked()
deep()''',
}


def tool_calls(codes: list[str]) -> str:
    return "".join(f"<tool_call>{json.dumps({'name': 'python', 'arguments': {'code': code}})}</tool_call>"
                   for code in codes)


def run_escapes(sandbox: PythonSandbox, names: list[str], params: dict) -> dict:
    """Each escape through ToolEnvironment.step, as the trainer runs the tool: what the model read back, the
    signals and the core limit this process saw, and the processes it still has."""
    received: list[int] = []
    handlers = {s: signal.signal(s, lambda number, frame: received.append(number))
                for s in (signal.SIGUSR1, signal.SIGUSR2)}
    core = resource.getrlimit(resource.RLIMIT_CORE)
    contents = {}
    values = {**params, "trainer": os.getpid(), "project": PROJECT}
    try:
        env = ToolEnvironment([make_tool(sandbox.tool_function())])
        for name in names:
            env.reset({"prompt": "q"})
            observation = env.step(tool_calls([PRELUDE + ESCAPES[name].format(**values)]))
            contents[name] = observation.messages[0]["content"]
        time.sleep(0.2)  # a signal on its way
        with open("/proc/self/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        return {"contents": contents, "signals": received, "core_changed": resource.getrlimit(resource.RLIMIT_CORE)
                != core, "children": children(), "cmdline": cmdline}
    finally:
        resource.setrlimit(resource.RLIMIT_CORE, core)
        for number, handler in handlers.items():
            signal.signal(number, handler)


def children() -> list[int]:
    """This process's living children (zombies would have been reaped)."""
    found = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            found += [int(pid) for pid in f.read().split()]
    return found


def tree(path: str) -> dict:
    """Every entry below `path`: its kind, mode and contents (files), to compare before and after."""
    seen = {}
    for folder, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(folder, name)
            info = os.lstat(full)
            content = open(full, "rb").read() if os.path.isfile(full) and not os.path.islink(full) else None
            seen[os.path.relpath(full, path)] = (info.st_mode, content)
    return seen


def marked_processes(marker: str) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def private_lines(path: str) -> list[str]:
    with open(path, errors="replace") as f:
        return [line for line in f.read().splitlines() if len(line) > 12][:3]


@pytest.fixture
def world():
    """What the escapes aim at, and what they must leave as it was."""
    marker = f"drgrpo-{uuid.uuid4().hex}"
    outside = tempfile.mkdtemp(prefix="drgrpo-outside-", dir="/tmp")  # not below pytest's 0700 folder
    with open(os.path.join(outside, "keep.txt"), "w") as f:
        f.write("keep")
    os.chmod(os.path.join(outside, "keep.txt"), 0o666)
    os.chmod(outside, 0o777)  # anyone may write here: only the sandbox stops it
    tmp = tempfile.mkdtemp(prefix="drgrpo-tmp-", dir="/tmp")
    os.chmod(tmp, 0o777)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    params = {"marker": marker, "outside": outside, "port": listener.getsockname()[1], "tmp": tmp}
    yield params, tree(outside), listener
    listener.close()
    for pid in marked_processes(marker):  # what an escape left (the old sandbox's): stop it
        os.kill(pid, signal.SIGKILL)
    for path in (f"/tmp/drgrpo-escape-{marker}", f"/dev/shm/drgrpo-escape-{marker}"):
        if os.path.lexists(path):
            os.remove(path)
    subprocess.run(["chmod", "-R", "u+rwX", outside, tmp], check=False)
    subprocess.run(["rm", "-rf", outside, tmp], check=False)


def assert_contained(world, result):
    """Nothing outside the tool's folder changed, nothing it read leaked back, no process of it survived."""
    params, before, listener = world
    text = "\n".join(result["contents"].values())
    assert "ESCAPED" not in text, text
    assert all("refused" in content for name, content in result["contents"].items()
               if name != "leave_an_unremovable_folder"), text  # the escape ran, and was stopped
    for secret in private_lines("/etc/passwd") + private_lines(os.path.join(PROJECT, "pyproject.toml")):
        assert secret not in text
    assert result["cmdline"] not in text
    assert tree(params["outside"]) == before
    assert not os.path.lexists(f"/tmp/drgrpo-escape-{params['marker']}")
    assert not [n for n in os.listdir("/dev/shm") if params["marker"] in n]
    assert os.listdir(params["tmp"]) == []  # the worker's folder is gone, whatever the code left in it
    assert marked_processes(params["marker"]) == [] and result["children"] == []
    assert result["signals"] == [] and not result["core_changed"]
    with pytest.raises(TimeoutError):
        listener.accept()


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_the_jail_contains_an_escape(name, world, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", world[0]["tmp"])
    result = run_escapes(make_sandbox(timeout_s=2), [name], world[0])
    assert_contained(world, result)


def test_the_jail_contains_every_escape_for_an_unprivileged_trainer(world, tmp_path):
    """The trainer as uid 65534 (root here; a mount namespace of its own makes the interpreter reachable)."""
    if os.getuid() != 0:
        pytest.skip("the suite runs unprivileged already: the other escape tests are this case")
    need_jail()
    script = [sys.executable, os.path.abspath(__file__), "escapes", json.dumps(world[0])]
    command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", *script]
    mounts = reachable_interpreter(tmp_path)
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           f'{mounts} && exec "$@"', "sh", *command],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["uid"] == 65534
    assert_contained(world, result)


def reachable_interpreter(stash) -> str:
    """Shell commands (run as root in a private mount namespace) giving uid 65534 the interpreter's prefix, when a
    folder above it (e.g. /root) is closed to others: a tmpfs covers that folder, the prefix bound back in."""
    prefix = os.path.realpath(sys.base_prefix)
    closed = next((p for p in ancestors(prefix) if not os.stat(p).st_mode & 0o001), None)
    if closed is None:
        return "true"
    return (f"mount --bind {prefix} {stash} && mount -t tmpfs -o mode=755 tmpfs {closed} && mkdir -p {prefix} && "
            f"mount --bind {stash} {prefix}")


def ancestors(path: str) -> list[str]:
    parts = path.strip("/").split("/")
    return ["/" + "/".join(parts[:i]) for i in range(1, len(parts))]


def main(argv: list[str]) -> None:
    """`escapes PARAMS_JSON`: every escape through the jailed tool, the results as one JSON line."""
    params = json.loads(argv[2])
    tempfile.tempdir = params["tmp"]
    result = run_escapes(make_sandbox(timeout_s=2), sorted(ESCAPES), params)
    print(json.dumps({**result, "uid": os.getuid()}))


if __name__ == "__main__":
    main(sys.argv)
