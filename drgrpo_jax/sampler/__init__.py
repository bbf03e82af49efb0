"""Generation, pure and jitted: the KV-cache sampler (each distinct prompt prefilled once, then decode phases
over a growing cache) and the per-row token draws (temperature, top-k/top-p, seeds). It uses `models` and
knows no service, trainer or HTTP: `serve` runs it behind the API.
"""
