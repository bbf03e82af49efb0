"""`python -m drgrpo_jax.launch ENGINE`: a run config rendered as the launch files of SLURM, GKE (JobSet + xpk) and
SkyPilot, with the hosts, chips and mesh the config (and so `python -m drgrpo_jax.plan`) states. Every host runs the
same command with `mesh.coordinator_address=auto`; exit code 42 (a preempted run that saved) means "restart"."""
