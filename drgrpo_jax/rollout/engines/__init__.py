"""The inference engines behind `rollout.urls`, one module each behind one interface (`base.Engine`): our service
(`native`), SGLang (`sglang`) and vLLM (`vllm`). `ENGINES` holds one of each by its `rollout.engine` name; what each
supports is its row of `config/engines.py`. A new engine is a module here, its entry below and its row there.
"""

from drgrpo_jax.rollout.engines.base import Engine
from drgrpo_jax.rollout.engines.native import NativeEngine
from drgrpo_jax.rollout.engines.sglang import SGLangEngine
from drgrpo_jax.rollout.engines.vllm import VLLMEngine

__all__ = ["ENGINES"]

ENGINES: dict[str, Engine] = {engine.name: engine for engine in (NativeEngine(), SGLangEngine(), VLLMEngine())}
