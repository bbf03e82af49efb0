"""The plan as a person reads it: `python -m drgrpo_jax.plan`'s text report of `planner.make_plan`'s dict (its
`--format json` prints the dict itself)."""

from __future__ import annotations

from typing import Any

from drgrpo_jax.plan.hardware import GIB
from drgrpo_jax.plan.planner import HEADROOM

__all__ = ["format_text"]


def _gib(n: int) -> str:
    return f"{n / GIB:9.2f} GiB"


def _axes(axes: str | list[str] | None) -> str:
    """One dimension of a partition spec as the text prints it: None, fsdp, or (fsdp, context)."""
    if axes is None or isinstance(axes, str):
        return str(axes)
    return "(" + ", ".join(axes) + ")"


def format_text(plan: dict[str, Any]) -> str:
    """The plan as a short human report."""
    m, mo, tr, sv = plan["mesh"], plan["model"], plan["trainer"], plan["service"]
    lora = (f"; LoRA rank {mo['lora_rank']}: {mo['adapter_parameters']:,} adapter parameters train, the base is "
            "frozen" if mo["lora_rank"] else "")
    lines = [f"model: {mo['source']}: {mo['family']}, {mo['parameters']:,} parameters, {mo['layers']} layers, "
             f"dtype {mo['dtype']}, remat {mo['remat']} -> {mo['remat_policy']}{lora}",
             f"mesh: data={m['data']} fsdp={m['fsdp']} tensor={m['tensor']} context={m['context']} -> "
             f"{m['devices']} devices "
             f"over {m['processes']} process(es); " + (
                 f"data crosses {m['dcn_data']} slices over DCN ({m['data'] // m['dcn_data']} data way(s) per "
                 "slice), fsdp, tensor and context stay on each slice's ICI" if m["dcn_axes"] else
                 "no axis crosses DCN"),
             "", "parameter partition specs (per device):"]
    for g in plan["param_groups"]:
        spec = "P(" + ", ".join(_axes(a) for a in g["spec"]) + ")"
        mib = g["bytes_per_device"] / 2**20
        lines.append(f"  {g['name']:<20} {str(tuple(g['shape'])):<24} {spec:<30} {mib:10.1f} MiB")
    rows = (f"{tr['model_call_rows']} packed row(s) for {tr['rows_per_device']} response(s)" if tr["packed"] else
            f"{tr['rows_per_device']} response(s)")
    split = (f", {tr['tokens_per_device']} of each on a device: mesh.context={m['context']} splits the tokens"
             if m["context"] > 1 else "")
    lines += ["", f"trainer, per device ({rows} of {tr['sequence']} tokens per micro-batch{split}):"]
    for key in ("params", "adapters", "optimizer", "gradients", "reference", "activations", "logprob_chunks", "batch",
                "total"):
        lines.append(f"  {key:<16} {_gib(tr[key])}")
    attention = "[S, S] probabilities kept" if tr["attention_probabilities"] else "memory-linear attention"
    lines.append(f"  activations by model.remat ({attention}): " + ", ".join(
        f"{name} {_gib(size).strip()}" for name, size in tr["activations_by_remat"].items()))
    if m["context"] > 1:
        t = tr["context_traffic"]
        lines.append(f"  context split, received per device: keys and values {_mib(t['forward_per_layer'])} per "
                     f"layer forward, at most {_mib(t['backward_per_layer'])} backward; {_gib(t['per_step']).strip()} "
                     "per optimizer step")
    where = "one device" if sv["devices"] == 1 else (
        f"one of its {sv['devices']} devices (--mesh {sv['mesh']}: tensor={sv['tensor_ways']} splits heads, MLP "
        f"and vocabulary, data={sv['data_ways']} the rows)")
    lines += ["", f"generation service, {where} ({sv['rows']} rows at once):"]
    for key in ("weights", "layer_split", "adapter_merge", "kv_cache", "recorded_experts", "prefill_attention",
                "decode_temporaries"):
        lines.append(f"  {key:<19} {_gib(sv[key])}")
    lines.append(f"  {'total':<19} {_gib(sv['total'])}  (the larger of prefill and decode temporaries counted)")
    if plan["device"] is None:
        lines += ["", "no target device: pass --device NAME or --device-memory GiB to check the fit"]
        return "\n".join(lines)
    d = plan["device"]
    lines += ["", f"device: {d['name']} ({d['source']}); usable {_gib(d['usable_bytes']).strip()} "
                  f"({HEADROOM:.0%} of {_gib(d['memory_bytes']).strip()})"]
    for part in ("trainer", "service"):
        verdict = "fits" if plan["fits"][part] else "DOES NOT FIT"
        lines.append(f"  {part}: {_gib(plan[part]['total']).strip()} -> {verdict}")
    if "together" in plan["fits"]:
        together = plan["trainer"]["total"] + plan["service"]["total"]
        verdict = "fits" if plan["fits"]["together"] else "DOES NOT FIT"
        lines.append(f"  trainer + its child service on this one device: {_gib(together).strip()} -> {verdict}")
    if "prefix_cache" in sv:
        lines.append(f"  service's prefix cache: up to {_gib(sv['prefix_cache']).strip()} "
                     "(rollout.service_prefix_cache_bytes; -1: an eighth of what its weights leave free, beside "
                     "batches within half; grows as prompts repeat)")
    if sv["smallest_tensor"] is not None:
        data = f",data={sv['data_ways']}" if sv["data_ways"] > 1 else ""
        lines.append(f"  the smallest service mesh that fits: --mesh tensor={sv['smallest_tensor']}{data}")
    else:
        lines.append("  no service mesh up to tensor=64 fits: lower rollout.service_batch_size or the token budgets")
    if tr["context_table"]:
        lines += _context_table(tr["context_table"])
    lines += [f"  change {line}" for line in plan["advice"]]
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _context_table(rows: list[dict[str, Any]]) -> list[str]:
    """The trainer's per-device memory at each mesh.context size (planner's context_table)."""
    lines = ["  trainer per device by mesh.context (the same devices, or more):",
             f"    {'context':>7} {'data':>4} {'fsdp':>4} {'tensor':>6} {'devices':>7} {'micro':>5} "
             f"{'activations':>12} {'total':>10} {'K/V per layer':>13}"]
    for r in rows:
        lines.append(f"    {r['context']:>7} {r['data']:>4} {r['fsdp']:>4} {r['tensor']:>6} {r['devices']:>7} "
                     f"{r['micro_batches']:>5} {_gib(r['activations'])[:-4].strip():>8} GiB "
                     f"{_gib(r['total'])[:-4].strip():>6} GiB {_mib(r['traffic_per_layer']):>13}"
                     f"  {'fits' if r['fits'] else 'does not fit'}")
    return lines
