"""`python -m drgrpo_jax.serve`: see drgrpo_jax.serve.cli."""

import sys

from drgrpo_jax.serve.cli import main

main(sys.argv[1:])
