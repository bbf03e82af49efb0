"""Evaluation through the generation service: `python -m drgrpo_jax.evaluate` and the trainer's periodic
evaluation share one path (greedy and k sampled completions per problem, scored with the training rewards,
summarised as accuracy, avg@k and unbiased pass@k), over reasoning-gym suites or the user's JSONL files.
"""
