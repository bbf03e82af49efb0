"""The Python tool's worker: its limits and its containment, with and without a network namespace."""

import os
import time

import pytest

from drgrpo_jax.environments.python_tool import PythonSandbox, namespaces_available
from drgrpo_jax.environments.tool_env import ToolEnvironment
from drgrpo_jax.environments.tools import make_tool
from drgrpo_jax.errors import PythonToolError

pytestmark = pytest.mark.subprocess  # every call starts a worker process

NAMESPACE_MODES = [False, pytest.param(True, marks=pytest.mark.skipif(
    not namespaces_available(), reason="this kernel refuses network namespaces"))]


@pytest.fixture(params=NAMESPACE_MODES, ids=["no-namespace", "namespace"])
def sandbox(request):
    return PythonSandbox(timeout_s=4, memory_mb=256, max_output_bytes=4096, namespaces=request.param)


def test_runs_code_in_an_empty_folder_of_its_own(sandbox):
    assert sandbox.call("import os, math\nprint(sorted(os.listdir('.')), math.factorial(20))") == \
        "['snippet.py'] 2432902008176640000\n"
    assert sandbox.call("open('a.txt', 'w').write('hi')\nprint(open('a.txt').read())") == "hi\n"


def test_writes_outside_its_folder_are_refused(sandbox, tmp_path):
    target = tmp_path / "outside.txt"
    os.chmod(tmp_path, 0o777)  # writable by anyone: only the sandbox stops it
    for code in (f"open({str(target)!r}, 'w').write('x')", f"import os\nos.mkdir({str(tmp_path / 'd')!r})",
                 "open('../escape.txt', 'w').write('x')", "open('/tmp/drgrpo-escape.txt', 'a').write('x')"):
        with pytest.raises(PythonToolError, match="PermissionError"):
            sandbox.call(code)
    assert not target.exists() and not (tmp_path / "d").exists() and not os.path.exists("/tmp/drgrpo-escape.txt")


def test_network_connections_are_refused(sandbox):
    with pytest.raises(PythonToolError, match="PermissionError: the sandbox refuses socket"):
        sandbox.call("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)")


def test_the_namespace_has_no_network_interface_but_loopback():
    if not namespaces_available():
        pytest.skip("this kernel refuses network namespaces")
    code = "print(sorted(line.split(':')[0].strip() for line in open('/proc/self/net/dev').readlines()[2:]))"
    assert PythonSandbox(namespaces=True).call(code) == "['lo']\n"
    assert PythonSandbox(namespaces=False).call(code) != "['lo']\n"  # the host's interfaces: the check can fail
    assert PythonSandbox(namespaces=True).run("pass").namespaced


def test_fork_without_bound_is_contained(sandbox):
    start = time.monotonic()
    with pytest.raises(PythonToolError, match="refuses os.fork"):
        sandbox.call("import os\nwhile True:\n    os.fork()")
    with pytest.raises(PythonToolError, match="refuses subprocess"):
        sandbox.call("import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])")
    assert time.monotonic() - start < 30


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


def test_ctypes_is_refused(sandbox):
    with pytest.raises(PythonToolError, match="refuses ctypes"):
        sandbox.call("import ctypes")


def test_a_killed_or_hanging_python_tool_is_a_tool_error_message():
    tool = make_tool(PythonSandbox(timeout_s=2).tool_function())
    env = ToolEnvironment([tool])
    env.reset({"prompt": "q"})
    code = {"hang": "import time\ntime.sleep(60)", "killed": "import os, signal\nos.kill(os.getpid(), 9)",
            "fine": "print(6 * 7)"}
    turn = "".join(f'<tool_call>{{"name": "python", "arguments": {{"code": {v!r}}}}}</tool_call>'.replace("'", '"')
                   for v in code.values())
    observation = env.step(turn.replace("\n", "\\n"))
    contents = [m["content"] for m in observation.messages]
    assert contents[0].startswith("error: PythonToolError: timed out after 2 s")
    assert contents[1].startswith("error: PythonToolError") and "refuses os.kill" in contents[1]
    assert contents[2] == "42\n"
    assert (observation.tool_calls, observation.tool_errors) == (3, 2)
