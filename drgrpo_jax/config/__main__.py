"""python -m drgrpo_jax.config --config X [overrides]: print the resolved config."""

import sys

from drgrpo_jax.config.load import config_from_argv, dump_config

sys.stdout.write(dump_config(config_from_argv(prog="python -m drgrpo_jax.config")))
