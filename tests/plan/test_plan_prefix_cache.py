"""The plan reports the generation service's prefix cache when the run turns it on (rollout.service_prefix_cache_bytes,
issue #65): at -1 an eighth of what the service's weights leave free on its device, beside batches within half."""

from __future__ import annotations

from drgrpo_jax.config.load import load_config
from drgrpo_jax.models.config import from_hf_config
from drgrpo_jax.plan import planner, report
from drgrpo_jax.plan.hardware import PRESETS, device_spec

MODEL = from_hf_config(PRESETS["Qwen2.5-Math-1.5B"])


def test_the_plan_reports_the_prefix_caches_budget_when_the_run_turns_it_on():
    config = load_config(None, ["model.path=x", "rollout.service_prefix_cache_bytes=-1"])
    plan = planner.make_plan(config, MODEL, device=device_spec("v5p"))
    service, usable = plan["service"], plan["device"]["usable_bytes"]
    free = usable - service["weights"] - service["layer_split"] - service["adapter_merge"]
    assert service["prefix_cache"] == free // 8 > 0
    assert service["prefix_cache"] + service["total"] <= usable  # beside the batches, within the device
    assert "service's prefix cache: up to" in report.format_text(plan)
    assert "prefix_cache" not in planner.make_plan(config, MODEL)["service"]  # no device: no budget to share
    fixed = load_config(None, ["model.path=x", "rollout.service_prefix_cache_bytes=1000000"])
    assert planner.make_plan(fixed, MODEL, device=device_spec("v5p"))["service"]["prefix_cache"] == 1000000


def test_the_plan_reports_no_prefix_cache_by_default():
    plan = planner.make_plan(load_config(None, ["model.path=x"]), MODEL, device=device_spec("v5p"))
    assert "prefix_cache" not in plan["service"] and "prefix cache" not in report.format_text(plan)
