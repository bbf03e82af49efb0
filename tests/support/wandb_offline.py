"""What an offline W&B run wrote, decoded from its .wandb file (tests/train/, tests/evaluate/)."""

from __future__ import annotations

import json
import os


def _wandb_records(path: str):
    """The protobuf records of a `run-ID.wandb` file: a LevelDB-style log of 32 KiB blocks, each record split
    into chunks with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    block, header = 32768, 7
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", path
    position, pending = header, b""
    while position + header <= len(data):
        left = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position:position + header]) if left >= header else (0, 0, 0)
        if left < header or (length == 0 and kind == 0):  # block trailer or zero padding
            position += left
            continue
        pending += data[position + header:position + header + length]
        position += header + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_offline_run(wandb_dir: str, timeout_s: float = 60.0) -> tuple[dict, list[dict]]:
    """(config, history rows) of the one offline run under wandb_dir, decoded from its .wandb file once W&B's
    service process has written the run's exit record (it writes behind `finish`)."""
    import glob
    import time

    (path,) = glob.glob(os.path.join(wandb_dir, "offline-run-*", "run-*.wandb"))
    deadline = time.monotonic() + timeout_s
    while not any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(path)):
        assert time.monotonic() < deadline, f"{path}: no exit record after {timeout_s} s"
        time.sleep(0.5)
    config, history = {}, []
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    return config, history
