"""The sampler's memory for one long prompt: prefilled PREFILL_CHUNK columns a program (as it is) against one
program over the whole prompt (as main did before issue #57, whose probe measured +1.1, +2.7 and +8.5 GB over an
idle service for 1,500, 3,000 and 6,000 prompt ids).

SmolLM2-135M's shape with random weights, one row, one new token, float32. Each (length, way) runs in a fresh
process, once to compile and once measured: the peak RSS (VmHWM, reset before the run) over the RSS before it, and
the run's wall time, against the sampler's own estimate of the
batch (`sampler/memory.py`, what the service's --max-batch-bytes budget admits work by). Prints one JSON line:

    {"benchmark": "prefill_memory", "rows": [{"prompt_ids": 1500, "chunked_mb": ..., "whole_mb": ...,
     "whole_over_chunked": ..., "planned_mb": ..., "chunked_s": ..., "whole_s": ...}, ...]}

    python benchmarks/prefill_memory.py [--lengths 1500 3000 6000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np
from flax import nnx

from drgrpo_jax.host_memory import return_freed_memory
from drgrpo_jax.models.config import DecoderConfig
from drgrpo_jax.sampler import generate as driver  # the module: its PREFILL_CHUNK is what generate reads
from drgrpo_jax.sampler.batch import RowRequest, SamplingParams, bucket, make_batch
from drgrpo_jax.sampler.memory import batch_memory, batch_peak

from _common import SMOLLM2_135M, smollm2


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def measure(length: int, whole: bool) -> dict:
    """In this process: the peak RSS the prefill of one `length`-id prompt adds, and its wall time."""
    if whole:  # one program over the whole prompt: main before the prefill was cut into parts
        driver.PREFILL_CHUNK = 1 << 30
    graphdef, state = nnx.split(smollm2(random_weights=True))
    prompt = tuple(np.random.default_rng(0).integers(3, 49152, length).tolist())
    row = RowRequest(prompt, SamplingParams(max_new_tokens=1), seed=1)
    batch = make_batch([row], (2,), batch_size=1, prompt_len=bucket(length))
    driver.generate(graphdef, state, batch, max_new_tokens=1).tokens_BT.block_until_ready()  # compiles
    return_freed_memory()
    idle = _status_mb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) starts again from here: compiling is not counted
        f.write("5")
    start = time.perf_counter()
    driver.generate(graphdef, state, batch, max_new_tokens=1).tokens_BT.block_until_ready()
    return {"added_mb": _status_mb("VmHWM") - idle, "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1500, 3000, 6000])
    parser.add_argument("--measure", nargs=2, metavar=("LENGTH", "WAY"), help=argparse.SUPPRESS)  # a child's part
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(int(args.measure[0]), args.measure[1] == "whole")))
        return

    def child(length: int, way: str) -> dict:
        done = subprocess.run([sys.executable, __file__, "--measure", str(length), way], capture_output=True,
                              text=True, check=True)
        return json.loads(done.stdout.splitlines()[-1])

    config = DecoderConfig(**SMOLLM2_135M)
    rows = []
    for length in args.lengths:
        chunked, whole = child(length, "chunked"), child(length, "whole")
        planned = batch_peak(batch_memory(config, 1, bucket(length), bucket(1), 4))
        rows.append({"prompt_ids": length, "chunked_mb": round(chunked["added_mb"]),
                     "whole_mb": round(whole["added_mb"]),
                     "whole_over_chunked": round(whole["added_mb"] / chunked["added_mb"], 2),
                     "planned_mb": round(planned / 2**20), "chunked_s": round(chunked["seconds"], 2),
                     "whole_s": round(whole["seconds"], 2)})
    print(json.dumps({"benchmark": "prefill_memory", "model": "SmolLM2-135M shape, random weights, float32",
                      "rows": rows}))


if __name__ == "__main__":
    main()
