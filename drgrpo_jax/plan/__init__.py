"""The plan: `python -m drgrpo_jax.plan` gives a run's mesh, partition specs and per-device memory (state from
`jax.eval_shape`, activations and the service by estimate) against the target device before anything runs;
the trainer asks it for `model.remat: auto`. `planner.py` makes the plan (over `state.py`, `activations.py`,
`service.py`, `hardware.py`), `remat.py` chooses the policy auto takes, `report.py` writes the text, `cli.py` is
the command line.
"""
