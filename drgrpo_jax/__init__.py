"""drgrpo_jax: Dr.GRPO ("GRPO done right") RL post-training of language models in JAX.

The public math, usable in any JAX trainer:

    from drgrpo_jax import loss_fn, LossConfig, window_stats, advantages
"""

from drgrpo_jax import advantages
from drgrpo_jax.algorithms import ALGORITHMS, Algorithm, check_algorithm_options, compute_advantages
from drgrpo_jax.losses import LossConfig, WindowStats, kl_divergence, loss_fn, window_stats

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "LossConfig",
    "WindowStats",
    "advantages",
    "check_algorithm_options",
    "compute_advantages",
    "kl_divergence",
    "loss_fn",
    "window_stats",
]
__version__ = "0.2.0"
