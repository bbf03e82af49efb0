"""The pure training step: `train_step(state, batch) -> (state, metrics)`, jitted with explicit shardings over
the (data, fsdp, tensor) mesh and donating the state. It owns what the step computes (`StepConfig`), the
batch and its micro-batches (padded or packed rows), the policy's forward (`policy`), the optimizer and what a step
reports (`metrics.StepMetrics`, one field per metric). It uses the math (`losses`) and `models`, and knows no host,
service or run config.
"""
