"""The inference engines a run's generation services may run (`rollout.engine`) and what each supports.

The config's rules ask this table, never an engine's name; `rollout/engines/` speaks each engine's wire and reads
its row here (the config sits below the rollout package, so the table lives on the lower floor). A new engine is a
name in `EngineName`, a row here and a module under `rollout/engines/` (`tests/rollout/test_engines.py` checks the
three agree).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

__all__ = ["ENGINE_TRAITS", "EngineName", "EngineTraits"]

EngineName = Literal["ours", "sglang", "vllm"]


@dataclasses.dataclass(frozen=True)
class EngineTraits:
    """What one inference engine supports, as the config's rules and the rollout client ask it."""

    label: str  # the engine's own name in messages
    starts_locally: bool  # the trainer runs it as its own child service when rollout.urls is empty
    loads_lora_adapters: bool  # a weight push may be a PEFT adapter folder (model.lora.push=adapter)
    inflight_updates: bool  # takes a push mid-round and reports each token's weight version
    reads_buckets: bool  # loads a pushed folder from a bucket (gs://), not only from its own disk
    serves_model_info: bool  # answers /get_model_info (the model's and tokenizer's paths)


ENGINE_TRAITS: dict[str, EngineTraits] = {
    "ours": EngineTraits(label="our service", starts_locally=True, loads_lora_adapters=True, inflight_updates=True,
                         reads_buckets=True, serves_model_info=True),
    "sglang": EngineTraits(label="SGLang", starts_locally=False, loads_lora_adapters=True, inflight_updates=False,
                           reads_buckets=True, serves_model_info=True),
    "vllm": EngineTraits(label="vLLM", starts_locally=False, loads_lora_adapters=False, inflight_updates=False,
                         reads_buckets=False, serves_model_info=False),
}
