"""Records a running vLLM server's answers to the calls rollout.engine=vllm makes, as the fixture the fast wire tests
replay (tests/rollout/vllm_wire.json), trimmed to the fields the client reads.

    python scripts/vllm/record_wire.py http://127.0.0.1:8000 MODEL_FOLDER [OUT]

The server must run as docs/engines.md says (dev mode, --enable-scale-out, --logprobs-mode processed_logprobs);
MODEL_FOLDER is the folder it serves, reloaded once as version "1".
"""

from __future__ import annotations

import json
import os
import sys

import httpx

from drgrpo_jax.rollout.engines import vllm


def record(url: str, model: str) -> dict:
    """The server's routes, version and log-prob mode, one generate call with its answer, and one weight push."""
    with httpx.Client(base_url=url, timeout=120) as http:
        config = http.get("/server_info", params={"config_format": "json"}).json()["vllm_config"]
        body = vllm.generate_body([1, 5, 6, 7], 3, 2, max_new_tokens=6, temperature=0.7, top_p=1.0, top_k=0,
                                  stop_token_ids=[], ignore_eos=False)
        answer = http.post(vllm.GENERATE_PATH, json=body).json()
        stopped_body = {**body, "sampling_params": {**body["sampling_params"], "stop_token_ids": [9], "n": 1}}
        stopped = http.post(vllm.GENERATE_PATH, json=stopped_body).json()
        held_before = http.get("/weight_info").json()
        pushes = []
        for path, push_body in vllm.weight_push_calls(os.path.abspath(model), "1"):
            response = http.post(path, json=push_body)
            pushes.append({"path": path, "status": response.status_code, "answer": response.text})
        return {
            "version": http.get("/version").json(),
            "openapi": {"paths": {path: {} for path in http.get("/openapi.json").json()["paths"]}},
            "server_info": {"vllm_config": {"model_config": {
                "logprobs_mode": config["model_config"]["logprobs_mode"]}}},
            "generate": {"request": body, "answer": answer},
            "generate_stop": {"request": stopped_body, "answer": stopped},
            "weight_info_before": held_before, "push": pushes, "weight_info_after": http.get("/weight_info").json(),
        }


if __name__ == "__main__":
    out = sys.argv[3] if len(sys.argv) > 3 else "tests/rollout/vllm_wire.json"
    with open(out, "w") as f:
        json.dump(record(sys.argv[1], sys.argv[2]), f, indent=1)
        f.write("\n")
    print(out)
