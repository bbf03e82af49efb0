"""The generation service: an HTTP process (SGLang-style native API + OpenAI completions) over the sampler.

    python -m drgrpo_jax.serve --model PATH [--host 127.0.0.1] [--port 30000]
    python -m drgrpo_jax.serve --config run.yaml    # reads `model.path`, `model.dtype` and a `serve:` section

Requests from concurrent clients are queued and cut into batches (rows = prompts x n); one worker
thread runs the jitted sampler on each batch with the weights current when the batch starts, so a
weight update (`/update_weights_from_disk`, or `/update_weights_from_tensor` from the trainer's shared
memory) swaps atomically between batches: batches in flight finish on the old weights, and every
completion reports the `weight_version` it was sampled with.

Layout (imports point one way, security, weights <- engine <- api <- tensor_updates, openai_routes <- app <-
__main__; schemas <- api):
    security.py       keys (Bearer, constant time), the Host and body-size guard, weight-path roots
    weights.py        Weights: loading (folder, adapter, shared-memory tensors), the compatibility check
    engine.py         ServeConfig and its YAML loading, the weights' hot swap, the batching Engine
    schemas.py        the request bodies, every field bounded to what the engine can hold
    api.py            the SGLang-native route handlers and the checks every route shares; build_app's core
    tensor_updates.py /update_weights_from_tensor: the trainer's push through a shared-memory segment
    scoring.py        log-probs of given sequences (OpenAI's echo, logprobs and top_logprobs)
    openai_routes.py  /v1/models, /v1/completions (stop strings, logprobs, echo), /v1/chat/completions
    app.py            build_app: every route behind the guard
    __main__.py       the CLI: flags, tokenizer, socket, parent watch, uvicorn
"""

from __future__ import annotations

from typing import Any

from drgrpo_jax.serve.api import BadRequest
from drgrpo_jax.serve.app import build_app
from drgrpo_jax.serve.engine import Engine, RowResult, ServeConfig, load_config
from drgrpo_jax.serve.weights import Weights, check_compatible, load_weights

# The CLI's names resolve on first use: importing them here would load `__main__` as a plain module before
# `python -m drgrpo_jax.serve` runs it (runpy then warns and executes a second copy).
_CLI_NAMES = ("bind_socket", "load_tokenizer", "main", "parse_args")


def __getattr__(name: str) -> Any:
    """`drgrpo_jax.serve.main` and the other CLI names, imported lazily (see _CLI_NAMES)."""
    if name in _CLI_NAMES:
        from drgrpo_jax.serve import __main__ as cli
        return getattr(cli, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [  # the CLI names among them resolve lazily (_CLI_NAMES)
    "BadRequest",
    "Engine",
    "RowResult",
    "ServeConfig",
    "Weights",
    "bind_socket",
    "build_app",
    "check_compatible",
    "load_config",
    "load_tokenizer",
    "load_weights",
    "main",
    "parse_args",
]
