"""python -m drgrpo_jax.launch: see drgrpo_jax/launch/cli.py."""

from drgrpo_jax.launch.cli import main

main()
