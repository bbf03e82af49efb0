"""The generation service: an HTTP process (SGLang-style native API + OpenAI completions) over the sampler.

    python -m drgrpo_jax.serve --model PATH [--host 127.0.0.1] [--port 30000]
    python -m drgrpo_jax.serve --config run.yaml    # reads `model.path`, `model.dtype` and a `serve:` section

Requests from concurrent clients are queued and cut into batches (rows = prompts x n); one worker
thread runs the jitted sampler on each batch with the weights current when the batch starts, so a
weight update (`/update_weights_from_disk`, or `/update_weights_from_tensor` from the trainer's shared
memory) swaps atomically between batches: batches in flight finish on the old weights, and every
completion reports the `weight_version` it was sampled with.

Layout (imports point one way: security, weights <- engine <- service <- native_routes, openai_routes <- app
<- cli; schemas and scoring beside them):
    security.py       keys (Bearer, constant time), the Host and body-size guard, weight-path roots
    weights.py        Weights: loading (folder, adapter, shared-memory tensors), the compatibility check
    engine.py         ServeConfig and its YAML loading, the weights' hot swap, the batching Engine
    schemas.py        the request bodies, every field bounded to what the engine can hold
    service.py        what every route shares: Service, BadRequest, request checks, tokenize/decode, running rows
    native_routes.py  SGLang's /generate, /health, /get_model_info, /update_weights_from_disk|_from_tensor, ...
    scoring.py        log-probs of given sequences (OpenAI's echo, logprobs and top_logprobs)
    openai_routes.py  /v1/models, /v1/completions (stop strings, logprobs, echo), /v1/chat/completions
    app.py            build_app: every route behind the guard, errors in OpenAI's shape
    cli.py            the CLI (`__main__.py` runs it): flags, tokenizer, socket, parent watch, uvicorn
"""

from drgrpo_jax.serve.app import build_app
from drgrpo_jax.serve.cli import bind_socket, main, parse_args, served_tokenizer
from drgrpo_jax.serve.engine import Engine, RowResult, ServeConfig, load_config
from drgrpo_jax.serve.service import BadRequest
from drgrpo_jax.serve.weights import Weights, check_compatible, load_weights

__all__ = [
    "BadRequest",
    "Engine",
    "RowResult",
    "ServeConfig",
    "Weights",
    "bind_socket",
    "build_app",
    "check_compatible",
    "load_config",
    "load_weights",
    "main",
    "parse_args",
    "served_tokenizer",
]
