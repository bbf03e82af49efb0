"""The plan reports the generation service's prefix cache (--prefix-cache-bytes' default, issue #65): an eighth of
what the service's weights leave free on its device, beside batches within half."""

from __future__ import annotations

from drgrpo_jax.config.load import load_config
from drgrpo_jax.models.config import from_hf_config
from drgrpo_jax.plan import planner, report
from drgrpo_jax.plan.hardware import PRESETS, device_spec


def test_the_plan_reports_the_prefix_caches_default_budget():
    config = load_config(None, ["model.path=x"])
    plan = planner.make_plan(config, from_hf_config(PRESETS["Qwen2.5-Math-1.5B"]), device=device_spec("v5p"))
    service, usable = plan["service"], plan["device"]["usable_bytes"]
    free = usable - service["weights"] - service["layer_split"] - service["adapter_merge"]
    assert service["prefix_cache"] == free // 8 > 0
    assert service["prefix_cache"] + service["total"] <= usable  # beside the batches, within the device
    assert "service's prefix cache: up to" in report.format_text(plan)
    assert "prefix_cache" not in planner.make_plan(config, from_hf_config(PRESETS["Qwen2.5-Math-1.5B"]))["service"]
