"""Issue #44's connection findings and issue #41's CLI findings against a real service process: slow headers, idle
keep-alive connections, a connection cap, oversized headers, slowly sent bodies; `--help` and a load error."""

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from drgrpo_jax.rollout.local_service import LocalServer

from support.tiny_models import write_tiny_llama

pytestmark = pytest.mark.subprocess  # the service runs as a child process

LIMITS = ["--header-timeout-s", "1", "--body-timeout-s", "1", "--keep-alive-s", "1", "--max-connections", "6",
          "--max-header-bytes", "4096"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = write_tiny_llama(str(tmp_path_factory.mktemp("connections") / "model"), max_position_embeddings=64)
    with LocalServer(model, extra_args=LIMITS) as srv:
        yield srv


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (or 30 s pass)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _error_of(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_slow_headers_are_answered_408_and_closed(server):
    socks = [_connect(server.url) for _ in range(3)]
    for sock in socks:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")  # and never the end of the headers
    start = time.monotonic()
    for sock in socks:
        status, error = _error_of(_read_all(sock))  # main: never closed (the read times out after 30 s)
        assert status == 408 and "headers" in error["message"], error
        sock.close()
    assert time.monotonic() - start < 15
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def test_an_idle_kept_alive_connection_is_closed(server):
    sock = _connect(server.url)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
    start = time.monotonic()
    raw = _read_all(sock)  # the answer, then the close once the connection idles past --keep-alive-s
    assert b" 200 " in raw.split(b"\r\n")[0] and time.monotonic() - start < 15
    sock.close()


def test_connections_beyond_the_cap_get_503_and_the_service_goes_on(server):
    held = [_connect(server.url) for _ in range(6)]
    for sock in held:
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # open, headers pending
    time.sleep(0.3)
    extra = _connect(server.url)
    status, error = _error_of(_read_all(extra))
    assert status == 503 and "--max-connections" in error["message"], error
    for sock in held:
        sock.close()
    time.sleep(0.3)
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def test_oversized_headers_get_400_in_openais_shape(server):
    sock = _connect(server.url)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 8192 + b"\r\n\r\n")
    status, error = _error_of(_read_all(sock))
    assert status == 400 and "--max-header-bytes" in error["message"], error


def test_a_slowly_sent_body_is_answered_408(server):
    sock = _connect(server.url)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"input_ids\": ")  # 86 bytes never come
    start = time.monotonic()
    status, error = _error_of(_read_all(sock))
    assert status == 408 and "body" in error["message"] and time.monotonic() - start < 15, error


def test_help_documents_every_visible_flag_and_hides_the_launchers():
    from drgrpo_jax.serve.cli import _parser

    parser = _parser()
    visible = [a for a in parser._actions if a.help != "==SUPPRESS==" and a.dest != "help"]
    assert all(a.help for a in visible), [a.option_strings for a in visible if not a.help]
    text = parser.format_help()
    assert "--parent-pid" not in text and "--port-file" not in text  # main: both shown, 12 flags without help
    assert parser.parse_args(["--parent-pid", "7", "--port-file", "f"]).parent_pid == 7  # still accepted


def test_a_model_that_cannot_load_is_one_line_and_exit_2(tmp_path):
    result = subprocess.run([sys.executable, "-m", "drgrpo_jax.serve", "--model", str(tmp_path / "nonexistent"),
                             "--port", "0"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]  # main: exit 1 and a 20-line traceback
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and len(lines) == 1, lines
    assert "--model" in lines[0] and "nonexistent" in lines[0]


def test_a_bad_limit_is_one_line_and_exit_2(capsys):
    from drgrpo_jax.serve import parse_args

    for argv, words in ((["--max-connections", "0"], "max_connections: must be >= 1"),
                        (["--request-timeout-s", "inf"], "request_timeout_s: must be a positive number"),
                        (["--default-max-tokens", "9000"], "default_max_tokens: 9000 exceeds max_tokens_limit")):
        with pytest.raises(SystemExit) as exit_:
            parse_args(["--model", "m", *argv])
        lines = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(lines) == 1 and words in lines[0], lines
