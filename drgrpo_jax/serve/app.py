"""The whole service's FastAPI application: SGLang-native routes (api.py), the trainer's shared-memory update
(tensor_updates.py) and OpenAI's (openai_routes.py)."""

from __future__ import annotations

from typing import Any

from drgrpo_jax.serve import api
from drgrpo_jax.serve.engine import Engine
from drgrpo_jax.serve.openai_routes import ROUTES as OPENAI_ROUTES
from drgrpo_jax.serve.security import Keys
from drgrpo_jax.serve.tensor_updates import ROUTES as TENSOR_ROUTES

__all__ = ["build_app"]


def build_app(engine: Engine, tokenizer: Any = None, *, keys: Keys | None = None, port_file: str = "", port: int = 0
              ) -> Any:
    """SGLang's `/generate`, `/update_weights_from_disk`, `/health`, ..., the trainer's `/update_weights_from_tensor`
    and OpenAI's `/v1/*`, behind the guard."""
    return api.build_app(engine, tokenizer, keys=keys, port_file=port_file, port=port,
                         extra_routes=(*TENSOR_ROUTES, *OPENAI_ROUTES))
