"""The CLI: `python -m drgrpo_jax.serve` loads the model, binds the port and serves until SIGINT/SIGTERM."""

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

import drgrpo_jax.serve
from drgrpo_jax.serve.api import build_app
from drgrpo_jax.serve.engine import DTYPES, Engine, ServeConfig, load_config

log = logging.getLogger("drgrpo_jax.serve")


def load_tokenizer(config: ServeConfig) -> Any:
    """The HF tokenizer next to the model, or None (then only token-id prompts are served)."""
    path = config.tokenizer or (config.model if os.path.isdir(config.model) else "")
    if not path:
        return None
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path)
    except Exception as error:  # noqa: BLE001 - a model without a tokenizer is still servable
        log.warning("no tokenizer at %s (%s); text prompts will be refused", path, error)
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
                                     description=drgrpo_jax.serve.__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML: a trainer config (model.path, model.dtype) and/or a serve: section")
    parser.add_argument("--model", help="HF folder or .gguf file to serve")
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
    args = vars(parser.parse_args(argv))
    config_path = args.pop("config")
    if config_path:
        config = load_config(config_path, args)
    else:
        config = ServeConfig(**{k: v for k, v in args.items() if v is not None})
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
    sock = bind_socket(config.host, config.port)  # first, so a taken port fails before the slow load
    engine = Engine(config)
    app = build_app(engine, load_tokenizer(config), port_file=config.port_file, port=sock.getsockname()[1])
    log.info("serving %s (version %s) on http://%s:%d", config.model, engine.weights.version, config.host,
             sock.getsockname()[1])
    if config.parent_pid:
        threading.Thread(target=_watch_parent, args=(config.parent_pid,), daemon=True).start()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    finally:
        engine.close()


if __name__ == "__main__":
    main(sys.argv[1:])
