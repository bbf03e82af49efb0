"""`python -m drgrpo_jax.evaluate`: see drgrpo_jax.evaluate.cli."""

import sys

from drgrpo_jax.evaluate.cli import main

sys.exit(main())
