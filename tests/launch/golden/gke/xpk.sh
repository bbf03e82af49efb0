#!/bin/bash
# The trainer through xpk instead of jobset.yaml (apply services.yaml first: the trainer reads their URLs).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
xpk workload create --cluster=CLUSTER --workload=drgrpo --tpu-type=v5p-64 --num-slices=1 --docker-image=us-docker.pkg.dev/p/r/drgrpo:1 --max-restarts=10 --command 'mkdir -p /config && echo IyB0aGUgcmVzb2x2ZWQgY29uZmlnCg== | base64 -d > /config/run.yaml && python3 -m drgrpo_jax.train --config /config/run.yaml mesh.coordinator_address=auto '"'"'rollout.urls=[http://drgrpo-gen-0.drgrpo-gen:30000,http://drgrpo-gen-1.drgrpo-gen:30000]'"'"' rollout.api_key_env=DRGRPO_API_KEY' --env-file="$here/api_key.env"
