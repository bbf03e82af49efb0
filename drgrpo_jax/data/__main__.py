"""`python -m drgrpo_jax.data`: see drgrpo_jax.data.cli."""

import sys

from drgrpo_jax.data.cli import main

sys.exit(main())
