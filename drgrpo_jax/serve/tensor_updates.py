"""POST /update_weights_from_tensor: a whole model from a shared-memory segment, for the trainer that started
this service (its push without a disk round trip; `drgrpo_jax.rollout.weight_push`).

Named after SGLang's in-process update, but the body is this service's own: the segment's name and its index
(`tensor_segment`), not serialized tensors. A segment lives on this machine only, so a service bound beyond
loopback refuses the route (403); the admin key guards it like /update_weights_from_disk.
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse

from drgrpo_jax.serve.api import _next_version, _service, _update_answer
from drgrpo_jax.serve.schemas import UpdateWeightsFromTensorRequest
from drgrpo_jax.serve.weights import InvalidWeights, check_newer

__all__ = ["ROUTES"]


async def update_weights_from_tensor(body: UpdateWeightsFromTensorRequest, request: Request) -> JSONResponse:
    """Loads the segment's tensors as the new weights (checked as a disk update is); 403 beyond loopback."""
    engine = _service(request).engine
    if not engine.config.loopback:
        return _update_answer(403, "segment: shared-memory updates are served on loopback only",
                              engine.weights.version)
    version = str(body.weight_version) if body.weight_version is not None else _next_version(engine.weights.version)
    index = [entry.model_dump() for entry in body.tensors]
    try:
        if not body.allow_rollback:
            check_newer(engine.weights.version, version)
        weights = await asyncio.to_thread(engine.update_weights_from_segment, body.segment, index, version,
                                          allow_rollback=body.allow_rollback)
    except (InvalidWeights, ValueError) as error:
        return _update_answer(400, str(error), engine.weights.version)
    return _update_answer(200, "Succeeded to update model weights.", weights.version)


ROUTES = (("POST", "/update_weights_from_tensor", update_weights_from_tensor),)
