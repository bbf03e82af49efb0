"""`python -m drgrpo_jax.plan`: see drgrpo_jax.plan.cli."""

import sys

from drgrpo_jax.plan.cli import main

sys.exit(main())
