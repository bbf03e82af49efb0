"""python -m drgrpo_jax.config --config X [overrides]: print the resolved config (a bad one, or a run.output_dir the
run could not write, exits 2 in one line)."""

import sys

from drgrpo_jax.config.load import config_from_argv, dump_config
from drgrpo_jax.config.rules import check_output_dir
from drgrpo_jax.errors import ConfigError

PROG = "python -m drgrpo_jax.config"
config = config_from_argv(prog=PROG)
try:
    check_output_dir(config.run)
except ConfigError as error:
    print(f"{PROG}: config error: {error}", file=sys.stderr)
    sys.exit(2)
sys.stdout.write(dump_config(config))
