"""`python -m drgrpo_jax.plan`: see drgrpo_jax.plan.planner."""

import sys

from drgrpo_jax.plan.planner import main

sys.exit(main())
