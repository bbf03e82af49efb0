"""The CLI of `python -m drgrpo_jax.serve`: flags (or a YAML config) to a ServeConfig, the tokenizer, the socket,
the watch on a parent trainer, and uvicorn serving until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from drgrpo_jax.errors import ConfigError
from drgrpo_jax.hub_ids import local_model_and_tokenizer
from drgrpo_jax.models.precision import DTYPES
from drgrpo_jax.models.pretrained import load_tokenizer
from drgrpo_jax.serve.app import build_app
from drgrpo_jax.serve.connections import guarded_protocol
from drgrpo_jax.serve.engine import Engine, ServeConfig, load_config
from drgrpo_jax.serve.security import read_keys
from drgrpo_jax.sharding import SERVICE_MESH_EXAMPLE, parse_service_mesh, service_mesh

__all__ = ["PROG", "bind_socket", "main", "parse_args", "served_tokenizer"]

PROG = "python -m drgrpo_jax.serve"
DESCRIPTION = "The generation service: an HTTP process (SGLang-style native API + OpenAI completions) over the sampler."

log = logging.getLogger("drgrpo_jax.serve")


def served_tokenizer(config: ServeConfig) -> Any:
    """The tokenizer of --tokenizer, else of the model when it is a folder or a .gguf file; None when there is
    none (a model without a tokenizer is still servable: only token-id prompts are)."""
    has_own = os.path.isdir(config.model) or config.model.endswith(".gguf")
    if not config.tokenizer and not has_own:
        log.warning("no tokenizer for %s (give --tokenizer); text prompts will be refused", config.model)
        return None
    try:
        return load_tokenizer(config.model, config.tokenizer or None)
    except ConfigError as error:
        log.warning("no tokenizer (%s); text prompts will be refused", error)
        return None


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0 = any free port), created before uvicorn so the port is known."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def _fail(message: str) -> NoReturn:
    """A config or load error: one line on stderr and exit status 2, as the trainer's."""
    sys.stderr.write(f"{PROG}: error: {message}\n")
    sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    """The flags, each with its help (defaults from ServeConfig); the launcher's own flags hidden."""
    defaults = ServeConfig()
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    add = parser.add_argument
    add("--config", metavar="YAML", help="a trainer config (model.path, model.dtype) and/or a serve: section; flags "
        "given here override it")
    add("--model", help="HF folder or .gguf file to serve, or a PEFT LoRA adapter folder (served on the base its "
        "adapter_config.json names)")
    add("--host", help=f"bind address (default {defaults.host}); beyond loopback a key is required")
    add("--port", type=int, help=f"TCP port (default {defaults.port}, SGLang's); 0 = any free port")
    add("--port-file", dest="port_file", help=argparse.SUPPRESS)  # the launcher's: where the bound port is written
    add("--parent-pid", dest="parent_pid", type=int, help=argparse.SUPPRESS)  # the launcher's: exit when it is gone
    add("--dtype", choices=sorted(DTYPES), help=f"parameter and KV-cache dtype (default {defaults.dtype})")
    add("--mesh", metavar="tensor=T[,data=D]",
        help=f"run the sampler over T x D of this host's devices: weights and KV cache split over heads, MLP and "
             f"vocabulary on tensor (the trainer's rules), rows on data; a row's tokens do not depend on it (e.g. "
             f"{SERVICE_MESH_EXAMPLE}; default: one device)")
    add("--weight-version", dest="weight_version", help=f"version reported until the first weight update (default "
        f"{defaults.weight_version})")
    add("--max-batch-size", dest="max_batch_size", type=int, help=f"rows (prompts x n) per sampler call (default "
        f"{defaults.max_batch_size})")
    add("--batch-wait-ms", dest="batch_wait_ms", type=float, help=f"after a request, wait this long for others to "
        f"batch with it (default {defaults.batch_wait_ms:g})")
    add("--max-context", dest="max_context", type=int, help="prompt + new tokens limit (default: the model's "
        "max_position_embeddings)")
    add("--tokenizer", metavar="DIR", help="tokenizer folder (default: the model's own; without one only token-id "
        "prompts are served)")
    add("--api-key-env", dest="api_key_env", metavar="NAME",
        help="every route but GET /health needs 'Authorization: Bearer <the value of $NAME>' (the key itself never "
             "goes on the command line, which `ps` shows)")
    add("--admin-key-env", dest="admin_key_env", metavar="NAME",
        help="a separate key (in $NAME) that alone may call /update_weights_from_disk")
    add("--allow-unauthenticated", dest="allow_unauthenticated", action="store_true", default=None,
        help="serve beyond loopback without a key (only on a network you trust)")
    add("--weights-root", dest="weights_roots", action="append", metavar="DIR",
        help="weight updates load only from folders under DIR, with no symbolic link below it (repeatable; "
             "gs://bucket/prefix too)")
    limits = parser.add_argument_group("limits (docs/serving-limits.md)")
    for flag, kind, text in (
            ("--max-request-tokens", int, "per request: prompts x n x (prompt + new tokens)"),
            ("--max-queued-tokens", int, "that measure over every request queued or running; beyond it: 429"),
            ("--max-body-bytes", int, "largest request body, however it is sent (413 beyond)"),
            ("--default-max-tokens", int, "new tokens of a chat completion that names no max_tokens"),
            ("--max-tokens-limit", int, "OpenAI routes: a larger max_tokens / max_completion_tokens is refused"),
            ("--request-timeout-s", float, "a request is answered by then: what was sampled, the rest with finish "
                                           "reason abort"),
            ("--max-scoring-bytes", int, "log-prob scoring's float32 temporaries per tile of positions x vocabulary"),
            ("--header-timeout-s", float, "a connection must send its request's headers within this (408 after)"),
            ("--body-timeout-s", float, "a request's body must arrive within this (408 after)"),
            ("--keep-alive-s", float, "an idle kept-alive connection is closed after this long"),
            ("--max-connections", int, "open connections beyond this are answered 503 and closed"),
            ("--max-header-bytes", int, "request line + headers beyond this: 400 and the connection closed"),
            ("--cancel-check-steps", int, "a running batch asks every this many decode steps whether its rows' "
                                          "clients are still there; the others stop there"),
            ("--max-kept-programs", int, "when the service goes idle holding more compiled sampler programs than "
                                         "this (one set per new batch shape, each holding host memory), it drops "
                                         "every compiled program and compiles again as shapes return; 0 = keep all"),
            ("--short-request-tokens", int, "requests of one batch asking for at most this many new tokens have "
                                            "their own worker: they never wait behind a long batch (0 = off)")):
        name = flag[2:].replace("-", "_")
        default = getattr(defaults, name)
        limits.add_argument(flag, dest=name, type=kind, metavar="SECONDS" if kind is float else "N",
                            help=f"{text} (default {default:g})" if kind is float else f"{text} (default {default})")
    return parser


def parse_args(argv: Sequence[str] | None) -> ServeConfig:
    """CLI flags (or --config YAML, flags overriding it) -> ServeConfig."""
    parser = _parser()
    args = vars(parser.parse_args(argv))
    config_path = args.pop("config")
    try:
        if config_path:
            config = load_config(config_path, args)
        else:
            config = ServeConfig(**{k: v for k, v in args.items() if v is not None})
    except (ValueError, TypeError, OSError) as error:
        _fail(" ".join(str(error).split()))
    if not config.model:
        _fail("--model (or model.path in --config) is required")
    try:  # parsed once; too few devices for it is said now, before the model loads
        service_mesh(parse_service_mesh(config.mesh, "--mesh"), "--mesh")
    except ValueError as error:
        _fail(str(error))
    try:  # a Hub id (org/name[@revision]) becomes its folder in the HF cache; offline and not cached: one line
        model, tokenizer = local_model_and_tokenizer(config.model, config.tokenizer)
    except ConfigError as error:
        _fail(str(error))
    return dataclasses.replace(config, model=model, tokenizer=tokenizer)


def _watch_parent(pid: int) -> None:
    """SIGTERMs this process once its parent is gone (a trainer killed before it could stop us)."""
    while os.getppid() == pid:
        time.sleep(1.0)
    log.warning("parent %d is gone; shutting down", pid)
    os.kill(os.getpid(), signal.SIGTERM)


def main(argv: Sequence[str] | None = None) -> None:
    """Loads the model, binds the port, serves until SIGINT/SIGTERM."""
    import uvicorn
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = parse_args(argv)
    try:
        keys = read_keys(config.api_key_env, config.admin_key_env)
    except ValueError as error:
        _fail(str(error))
    try:
        sock = bind_socket(config.host, config.port)  # first, so a taken port fails before the slow load
    except OSError as error:
        _fail(f"--port: cannot listen on {config.host}:{config.port}: {error.strerror}")
    try:
        engine = Engine(config)
    except Exception as error:  # noqa: BLE001 - whatever the loaders raise: one line, as the trainer's errors
        _fail(f"--model: cannot load {config.model}: {type(error).__name__}: {' '.join(str(error).split())[:500]}")
    app = build_app(engine, served_tokenizer(config), keys=keys, port_file=config.port_file,
                    port=sock.getsockname()[1])
    if not config.loopback and not config.weights_roots:
        log.warning("no --weights-root: /update_weights_from_disk refuses every path on this non-loopback service")
    where = "one device" if engine.mesh is None else (
        f"{engine.mesh.size} devices (data={engine.mesh.shape['data']}, tensor={engine.mesh.shape['tensor']})")
    log.info("serving %s (version %s) on %s at http://%s:%d", config.model, engine.weights.version, where,
             config.host, sock.getsockname()[1])
    if config.parent_pid:
        threading.Thread(target=_watch_parent, args=(config.parent_pid,), daemon=True).start()
    server = uvicorn.Server(uvicorn.Config(
        app, log_level="warning", timeout_graceful_shutdown=5, timeout_keep_alive=config.keep_alive_s,  # type: ignore[arg-type]
        h11_max_incomplete_event_size=config.max_header_bytes,
        http=guarded_protocol(config.header_timeout_s, config.max_connections, config.max_header_bytes)))
    try:
        server.run(sockets=[sock])
    finally:
        engine.close()

