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

import uvicorn

from drgrpo_jax.config.serve import ServeConfig, add_flags, load_serve_config
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.hub_ids import local_model_and_tokenizer
from drgrpo_jax.models.pretrained import load_tokenizer
from drgrpo_jax.serve.app import build_app
from drgrpo_jax.serve.connections import guarded_protocol
from drgrpo_jax.serve.scheduler import Scheduler
from drgrpo_jax.serve.security import read_keys
from drgrpo_jax.serve.service import shown_name
from drgrpo_jax.sharding import parse_service_mesh, service_mesh

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
    """--config and ServeConfig's flags (config/serve.py: each with its help; the launcher's own hidden)."""
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    parser.add_argument("--config", metavar="YAML", help="a trainer config (model.path, model.dtype) and/or a serve: "
                        "section; flags given here override it")
    add_flags(parser)
    return parser


def parse_args(argv: Sequence[str] | None) -> ServeConfig:
    """CLI flags (or --config YAML, flags overriding it) -> ServeConfig."""
    parser = _parser()
    args = vars(parser.parse_args(argv))
    config_path = args.pop("config")
    try:
        config = load_serve_config(config_path, args)
    except (ValueError, TypeError, OSError) as error:
        _fail(" ".join(str(error).split()))
    if not config.model:
        _fail("--model (or model.path in --config) is required")
    try:  # parsed once; too few devices for it is said now, before the model loads
        service_mesh(parse_service_mesh(config.mesh, "--mesh"), "--mesh")
    except ValueError as error:
        _fail(str(error))
    try:  # a Hub id becomes its folder in the HF cache, pkg:NAME its .gguf (hub_ids.local_model); else one line
        model, tokenizer = local_model_and_tokenizer(config.model, config.tokenizer)
    except ConfigError as error:
        _fail(str(error))
    # Responses name the model as given (the Hub id, or its folder's name), never its folder on this server.
    return dataclasses.replace(config, model=model, tokenizer=tokenizer,
                               served_model_name=config.served_model_name or shown_name(config.model))


def _watch_parent(pid: int) -> None:
    """SIGTERMs this process once its parent is gone (a trainer killed before it could stop us)."""
    while os.getppid() == pid:
        time.sleep(1.0)
    log.warning("parent %d is gone; shutting down", pid)
    os.kill(os.getpid(), signal.SIGTERM)


def main(argv: Sequence[str] | None = None) -> None:
    """Loads the model, binds the port, serves until SIGINT/SIGTERM."""
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
        scheduler = Scheduler(config)
    except Exception as error:  # noqa: BLE001 - whatever the loaders raise: one line, as the trainer's errors
        _fail(f"--model: cannot load {config.model}: {type(error).__name__}: {' '.join(str(error).split())[:500]}")
    app = build_app(scheduler, served_tokenizer(config), keys=keys, port_file=config.port_file,
                    port=sock.getsockname()[1])
    if not config.loopback and not config.weights_roots:
        log.warning("no --weights-root: /update_weights_from_disk refuses every path on this non-loopback service")
    where = "one device" if scheduler.mesh is None else (
        f"{scheduler.mesh.size} devices (data={scheduler.mesh.shape['data']}, tensor={scheduler.mesh.shape['tensor']})")
    log.info("serving %s (version %s) on %s at http://%s:%d", config.model, scheduler.weights.version, where,
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
        scheduler.close()

