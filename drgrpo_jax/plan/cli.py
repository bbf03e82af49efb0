"""A run's mesh, partition specs and per-device memory, before anything runs (jax.eval_shape only).

    python -m drgrpo_jax.plan --config PATH [section.key=value ...] [--device NAME | --device-memory GiB]
                              [--model-config NAME|PATH] [--serve-batch-size ROWS] [--serve-mesh tensor=T[,data=D]]
                              [--format text|json]

The command line: flags to `planner.make_plan`, printed by `report.format_text` or as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from drgrpo_jax.config.load import load_config
from drgrpo_jax.config.schema import Config
from drgrpo_jax.errors import ConfigError, MissingValueError
from drgrpo_jax.plan.hardware import DEVICES, GIB, PRESETS, DeviceSpec, device_spec
from drgrpo_jax.plan.planner import make_plan, resolve_decoder_config
from drgrpo_jax.plan.report import format_text

__all__ = ["main"]


def _load(config_path: str | None, overrides: list[str]) -> tuple[Config, list[str]]:
    """The config; model.path / data.path left empty are filled with a placeholder (the plan reads neither)."""
    filled: list[str] = []
    while True:
        try:
            return load_config(config_path, overrides + [f"{k}=unset" for k in filled]), filled
        except ConfigError as error:
            unset = isinstance(error, MissingValueError) and error.key in ("model.path", "data.path")
            if not unset or error.key in filled:
                raise
            filled.append(error.key)


def main(argv: list[str] | None = None) -> int:
    """The CLI; a bad config or argument exits 2 with one line."""
    parser = argparse.ArgumentParser(prog="python -m drgrpo_jax.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="the run's YAML (omit for the defaults)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, as for drgrpo_jax.train")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--device", help=f"target device: {', '.join(DEVICES)}")
    target.add_argument("--device-memory", type=float, help="target device memory in GiB")
    parser.add_argument("--model-config", help=f"the architecture: an HF folder, a config.json, a Hub id "
                                               f"org/name[@revision] (its config.json alone is fetched) or a preset "
                                               f"({', '.join(PRESETS)}); default: model.path's")
    parser.add_argument("--serve-batch-size", type=int,
                        help="rows one generation service samples at once (default: rollout.service_batch_size)")
    serve = parser.add_mutually_exclusive_group()
    serve.add_argument("--serve-mesh", metavar="tensor=T[,data=D]",
                       help="one generation service's mesh, as drgrpo_jax.serve --mesh takes it (default: "
                            "rollout.service_mesh, else one device): its figures are per device of it")
    serve.add_argument("--serve-tensor", type=int, default=1, metavar="T",
                       help="the same as --serve-mesh tensor=T")
    parser.add_argument("--format", choices=("text", "json"), default="text",
                        help="text: the plan as a table with advice (default); json: the same as one JSON object")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # eval_shape needs no accelerator
    try:
        config, filled = _load(args.config, args.overrides)
        model, source = resolve_decoder_config(config if "model.path" not in filled else dataclasses.replace(
            config, model=dataclasses.replace(config.model, path="")), args.model_config)
        device = None
        if args.device:
            device = device_spec(args.device)
        elif args.device_memory is not None:
            if not args.device_memory > 0:
                raise ConfigError("--device-memory", f"must be > 0 GiB, got {args.device_memory}")
            device = DeviceSpec(f"{args.device_memory:g} GiB", int(args.device_memory * GIB), "--device-memory")
        if args.serve_batch_size is not None and args.serve_batch_size < 1:
            raise ConfigError("--serve-batch-size", f"must be >= 1, got {args.serve_batch_size}")
        if args.serve_tensor < 1:
            raise ConfigError("--serve-tensor", f"must be >= 1, got {args.serve_tensor}")
        plan = make_plan(config, model, device=device, serve_batch_size=args.serve_batch_size, model_source=source,
                         serve_mesh=args.serve_mesh, serve_tensor=args.serve_tensor)
    except ConfigError as error:
        print(f"python -m drgrpo_jax.plan: config error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(plan) if args.format == "json" else format_text(plan))
    return 0
