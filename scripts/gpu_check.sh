#!/usr/bin/env bash
# The GPU checks of long responses (issue #14) as one prepared run on a machine with an NVIDIA GPU; the project
# never needs one. The GPU's image brings JAX with CUDA, PyTorch and transformers; this checkout needs no install
# (the repository root goes on PYTHONPATH), and the benchmark uses random weights of SmolLM2-135M's shape, so
# nothing is downloaded.
#   1. benchmarks/long_context.py --device gpu (ours vs PyTorch, train step and sampler), recorded by
#      benchmarks/record.py;
#   2. pytest -m gpu tests/models/test_attention.py: cuDNN flash attention and our blockwise kernel against the float32
#      reference (values and gradients; causal, left padding, packed segments, sliding windows), and `auto`
#      picking cuDNN inside the models.
#
#     scripts/gpu_check.sh OUT_DIR [COMMIT]
#
# OUT_DIR gets the logs and the record; COMMIT names the checkout where its .git is missing or stale (a copy
# sent to a GPU machine may carry an older .git: commit first, then pass the hash). Exits non-zero if either part
# fails; both always run.
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUT_DIR [COMMIT]}
commit=${2:-}
python=${PYTHON:-python3}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export JAX_PLATFORMS=cuda,cpu  # tests/conftest.py would otherwise pick the CPU

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$out/gpu.txt"
$python -c "import jax, flax, optax, torch, transformers
print('jax', jax.__version__, jax.devices(), '| flax', flax.__version__, '| optax', optax.__version__,
      '| torch', torch.__version__, torch.cuda.is_available(), '| transformers', transformers.__version__)" \
    2>&1 | tee -a "$out/gpu.txt"

status=0

# The benchmark first, on a quiet machine: record.py refuses a 1-minute load >= 1, so wait out the start's.
for _ in $(seq 18); do awk '{exit !($1 < 1)}' /proc/loadavg && break; sleep 5; done
before=$(ls benchmarks/results)
timeout 380 $python benchmarks/record.py ${commit:+--commit "$commit"} \
    --note "scripts/gpu_check.sh: random weights of SmolLM2-135M's shape (no registry on the GPU machine)" \
    -- $python benchmarks/long_context.py --device gpu --random-weights --dtype bfloat16 --repeats 3 \
    --timeout 150 2>&1 | tee "$out/long_context.log" || status=1
for record in $(ls benchmarks/results); do
    grep -qx "$record" <<<"$before" || cp "benchmarks/results/$record" "$out/"
done

timeout 150 $python -m pytest -q -rs -m gpu tests/models/test_attention.py -p no:cacheprovider 2>&1 \
    | tee "$out/gpu_tests.log" || status=1
exit $status
