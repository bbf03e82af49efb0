"""Prompts and reference answers: where examples come from (`sources`: reasoning-gym tasks, local JSONL/Parquet,
HF datasets local or on the Hub), their order (`order`: a pure function of the position, so a run resumes from
one integer), the prompt text (`prompts`), the answer parser data preparation and the rewards share (`answers`),
and `python -m drgrpo_jax.data prepare` (`prepare`, `cli`), which writes the public math sets as the
problem/answer JSONL the configs read. Evaluation suites load through `sources` too.
"""
