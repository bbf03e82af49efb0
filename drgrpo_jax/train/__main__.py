"""`python -m drgrpo_jax.train`: see drgrpo_jax.train.cli."""

import sys

from drgrpo_jax.train.cli import main

sys.exit(main())
