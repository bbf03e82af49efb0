"""The CLI of `python -m drgrpo_jax.serve`: flags (or a YAML config) to a ServeConfig, the tokenizer, the socket,
the watch on a parent trainer, and uvicorn serving until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from drgrpo_jax.errors import ConfigError
from drgrpo_jax.models.precision import DTYPES
from drgrpo_jax.models.pretrained import load_tokenizer
from drgrpo_jax.serve.app import build_app
from drgrpo_jax.serve.engine import Engine, ServeConfig, load_config
from drgrpo_jax.serve.security import read_keys

__all__ = ["bind_socket", "main", "parse_args", "served_tokenizer"]

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


def parse_args(argv: Sequence[str] | None) -> ServeConfig:
    """CLI flags (or --config YAML, flags overriding it) -> ServeConfig."""
    parser = argparse.ArgumentParser(prog="python -m drgrpo_jax.serve",
                                     description=DESCRIPTION)
    parser.add_argument("--config", help="YAML: a trainer config (model.path, model.dtype) and/or a serve: section")
    parser.add_argument("--model", help="HF folder or .gguf file to serve, or a PEFT LoRA adapter folder (served on "
                                         "the base its adapter_config.json names)")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--port-file", dest="port_file")
    parser.add_argument("--dtype", choices=sorted(DTYPES))
    parser.add_argument("--weight-version", dest="weight_version")
    parser.add_argument("--max-batch-size", dest="max_batch_size", type=int)
    parser.add_argument("--batch-wait-ms", dest="batch_wait_ms", type=float)
    parser.add_argument("--max-context", dest="max_context", type=int)
    parser.add_argument("--tokenizer")
    parser.add_argument("--parent-pid", dest="parent_pid", type=int)
    parser.add_argument("--api-key-env", dest="api_key_env", metavar="NAME",
                        help="every route but GET /health needs 'Authorization: Bearer <the value of $NAME>' "
                             "(the key itself never goes on the command line, which `ps` shows)")
    parser.add_argument("--admin-key-env", dest="admin_key_env", metavar="NAME",
                        help="a separate key (in $NAME) that alone may call /update_weights_from_disk")
    parser.add_argument("--allow-unauthenticated", dest="allow_unauthenticated", action="store_true", default=None,
                        help="serve beyond loopback without a key (only on a network you trust)")
    parser.add_argument("--weights-root", dest="weights_roots", action="append", metavar="DIR",
                        help="weight updates load only from folders under DIR (repeatable; gs://bucket/prefix too)")
    parser.add_argument("--max-request-tokens", dest="max_request_tokens", type=int)
    parser.add_argument("--max-queued-tokens", dest="max_queued_tokens", type=int)
    parser.add_argument("--max-body-bytes", dest="max_body_bytes", type=int)
    args = vars(parser.parse_args(argv))
    config_path = args.pop("config")
    try:
        if config_path:
            config = load_config(config_path, args)
        else:
            config = ServeConfig(**{k: v for k, v in args.items() if v is not None})
    except (ValueError, TypeError, OSError) as error:
        parser.error(" ".join(str(error).split()))
    if not config.model:
        parser.error("--model (or model.path in --config) is required")
    return config


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
        sys.exit(f"python -m drgrpo_jax.serve: error: {error}")
    sock = bind_socket(config.host, config.port)  # first, so a taken port fails before the slow load
    engine = Engine(config)
    app = build_app(engine, served_tokenizer(config), keys=keys, port_file=config.port_file,
                    port=sock.getsockname()[1])
    if not config.loopback and not config.weights_roots:
        log.warning("no --weights-root: /update_weights_from_disk refuses every path on this non-loopback service")
    log.info("serving %s (version %s) on http://%s:%d", config.model, engine.weights.version, config.host,
             sock.getsockname()[1])
    if config.parent_pid:
        threading.Thread(target=_watch_parent, args=(config.parent_pid,), daemon=True).start()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    finally:
        engine.close()

