"""The trainer: `python -m drgrpo_jax.train`. Set-up (`setup`), the host loop (`loop`: collect -> advantages ->
update -> push -> checkpoint, one call per stage), the step's rollout collection across hosts (`collect`,
`prefetch`), what it writes (checkpoints, the run log and its trackers, metrics rows, the Hub) and the
run's seeds. The only package with side effects beside `serve`; it sits above everything else.
"""
