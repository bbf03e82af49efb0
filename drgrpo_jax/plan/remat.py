"""`model.remat: auto` made concrete: which rematerialisation policy the plan, and so the trainer, takes for a
config on a device, from each policy's activation estimate (plan/activations.py) and the memory left for them.

`planner.auto_remat` asks it for the trainer's own device; `python -m drgrpo_jax.plan` shows the pick.
"""

from __future__ import annotations

from drgrpo_jax.config.schema import Config
from drgrpo_jax.plan.activations import choose_remat, model_call

__all__ = ["CPU_AUTO_REMAT", "CPU_KEEP_ATTENTION_FROM", "CPU_LONG_AUTO_REMAT", "cpu_auto_remat", "resolve_remat"]

# On a CPU the backward that recomputes each layer is no slower than one that keeps its activations (the saved
# tensors' memory traffic costs what the recompute does), at half the memory (benchmarks/results/train_step-*:
# remat none vs full). So auto takes full on a CPU, except from CPU_KEEP_ATTENTION_FROM tokens a row, where
# rerunning the attention's forward (quadratic) costs more than keeping its output; shorter rows gain nothing
# from keeping it but the memory it takes.
CPU_AUTO_REMAT = "full"
CPU_LONG_AUTO_REMAT = "save_attention_out"
CPU_KEEP_ATTENTION_FROM = 2048


def cpu_auto_remat(seq_len: int, attention_impl: str = "auto") -> str:
    """The policy auto prefers on a CPU for rows of `seq_len` tokens (before asking whether it fits)."""
    keep = seq_len >= CPU_KEEP_ATTENTION_FROM and attention_impl != "reference"
    return CPU_LONG_AUTO_REMAT if keep else CPU_AUTO_REMAT


def resolve_remat(config: Config, by_policy: dict[str, int], budget: int | None, backend: str = "cpu") -> str:
    """model.remat made concrete: a policy as set; for auto on a known device (`budget` bytes; None: no device, so
    none) on a CPU `cpu_auto_remat`'s pick where it fits, else CPU_AUTO_REMAT; elsewhere the first policy whose
    activations fit `budget`."""
    if config.model.remat != "auto":
        return config.model.remat
    if budget is None:
        return "none"
    if backend != "cpu":
        return choose_remat(by_policy, budget)
    preferred = cpu_auto_remat(model_call(config)[1], config.model.attention_impl)
    return preferred if by_policy[preferred] <= budget else CPU_AUTO_REMAT
