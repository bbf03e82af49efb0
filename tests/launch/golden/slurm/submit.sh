#!/bin/bash
set -euo pipefail
mkdir -p /shared/launch/logs  # SLURM opens the logs, it makes no folder
# The services, then the trainer once they run (it waits for their URLs). Arguments: overrides for the trainer.
serve=$(sbatch --parsable /shared/launch/serve.sbatch)
sbatch --parsable --dependency=after:$serve --export=ALL,DRGRPO_SERVE_JOB=$serve /shared/launch/train.sbatch "$@"
