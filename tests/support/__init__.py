"""What the tests share, one module per concern; test modules import from here, never from one another.

tests/ is on the path of the tests (conftest), of the worker scripts here and of the trainer children the
tests start (their PYTHONPATH), so this package is imported as `support`:

- paths: the repository and tests folders.
- tiny_models: the tiny random models (a transformers Llama saved with a character-level tokenizer, the
  step's and the sampler's in-memory Transformers).
- trainer_runs: the trainer CLI as a child process on the tiny model (overrides, environment, kill and resume)
  and its prompt file.
- reward_functions: the rewards trainer children import by path (`support.reward_functions:has_letter_a`).
- tiny_step: the sharded training step on the tiny model (its window, shared jitted steps, LoRA steps).
- step_metrics: host `StepMetrics` with distinct values in every field.
- compiled: the dot types of a compiled XLA program.
- gdpo_batches: GDPO's multi-component reward batches.
- oracles: float64 numpy oracles of the advantages and losses; full_cache_sampler: the sampler's oracle.
- wandb_offline: what an offline W&B run wrote.
- hf_cache: a temporary Hugging Face cache in huggingface_hub's layout, read offline.
- hub_stand_in: a local stand-in for the Hub's upload API (run.push_to_hub).
- two_processes, with multihost_worker.py and gdpo_two_process_worker.py: two-process `jax.distributed` runs.
"""
