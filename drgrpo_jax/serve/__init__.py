"""The generation service: an HTTP process (SGLang-style native API + OpenAI completions) over the sampler,
`python -m drgrpo_jax.serve --model PATH` (or `--config run.yaml`: its `model.path`, `model.dtype` and `serve:`
section; the settings, their flags and their YAML: config/serve.py). `scheduler.py` batches requests
within `batch_budget.py`'s memory, `weight_swap.py` hot-swaps the weights, `service.py` holds what every route
shares, `native_routes.py` and `openai_routes.py` answer (`stops.py` cuts stop strings, `scoring.py` scores
log-probs in tiles), `app.py` puts them behind `security.py`'s guard, `cli.py` starts it under uvicorn with
`connections.py`'s limits. Every limit: docs/serving-limits.md.
"""

from drgrpo_jax.serve.app import build_app
from drgrpo_jax.serve.cli import bind_socket, main, parse_args, served_tokenizer
from drgrpo_jax.serve.scheduler import RowResult, Scheduler
from drgrpo_jax.serve.weights import Weights, check_compatible, load_weights

__all__ = [
    "Scheduler",
    "RowResult",
    "Weights",
    "bind_socket",
    "build_app",
    "check_compatible",
    "load_weights",
    "main",
    "parse_args",
    "served_tokenizer",
]
