#!/bin/bash
set -euo pipefail
cd /shared/drgrpo_jax
mkdir -p /shared/launch/logs  # SLURM opens the logs, it makes no folder
# The services, then the trainer once they run (it waits for their URLs).
serve=$(sbatch --parsable --output=/shared/launch/logs/drgrpo-serve_%j.log /shared/launch/serve.sbatch); serve=${serve%%;*}  # id[;cluster]
sbatch --parsable --dependency=after:"$serve" --export=ALL,DRGRPO_SERVE_JOB="$serve" --output=/shared/launch/logs/drgrpo-train_%j.log /shared/launch/train.sbatch "$@"
