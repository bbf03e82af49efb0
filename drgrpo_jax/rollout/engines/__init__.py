"""The inference engines behind `rollout.urls`, one module each behind one interface (`base.Engine`): our service
(`native`), SGLang (`sglang`) and vLLM (`vllm`). The client's registry `rollout.client.ENGINES` holds one of each,
keyed by its `rollout.engine` name; what each supports is its row of `config/engines.py`.
"""
