"""mesh.context in the plan: the per-device activations, the keys and values the split sends, the table of context
sizes and the advice that names one that fits."""

from __future__ import annotations

import os

import pytest

from drgrpo_jax.errors import ConfigError
from drgrpo_jax.models.attention import block_widths
from drgrpo_jax.models.config import from_hf_config
from drgrpo_jax.plan import cli, report
from drgrpo_jax.plan import context as ctx
from drgrpo_jax.plan import planner as plan
from drgrpo_jax.plan.activations import activation_bytes, gathered_kv_bytes, rows_per_device
from drgrpo_jax.plan.hardware import PRESETS, device_spec

from support.paths import REPO

CONFIG_7B_V5P = os.path.join(REPO, "configs", "recipes", "qwen2.5_math_7b_dr_grpo_v5p64.yaml")
MODEL_7B = from_hf_config(PRESETS["Qwen2.5-Math-7B"])
# The issue's example: the paper's 7B at 32,768 new tokens, one response per device (128 / 4 / 32), on 16 GiB v5e.
LONG_ROWS = ["rollout.max_new_tokens=32768", "train.micro_batches=4"]
GIB = 2**30


def _config(*overrides: str):
    return cli._load(CONFIG_7B_V5P, list(overrides))[0]


def _plan(*overrides: str, device: str | None = None):
    return plan.make_plan(_config(*overrides), MODEL_7B, device=None if device is None else device_spec(device),
                          serve_batch_size=32, backend="tpu")


def test_full_remat_activations_split_the_tokens_and_keep_the_gathered_keys_whole():
    """Hand arithmetic of plan/activations.py's remat-full figure at context = 2: each device holds s = S / 2 tokens
    of each row; one layer's all-gathered keys and values (and their gradient) are of the whole row."""
    D, I, L, Q, C, H, a = 3584, 18944, 28, 28, 4, 128, 2
    S = 1024 + 32768 - 1  # the tokens the model reads
    s = -(-S // 2)
    config = _config(*LONG_ROWS, "mesh.context=2")
    assert rows_per_device(config) == 1
    none = 2 * s * (4 * D + (2 * Q + 2 * C) * H + 3 * I) * a + Q * s * 4  # memory-linear attention: its log-sum-exp
    full = s * D * a
    W, V = block_widths(s)
    gathered = 2 * S * C * H * a
    assert gathered_kv_bytes(config, MODEL_7B, S) == gathered
    expected = L * full + (none - full) + 3 * Q * W * V * 4 + 2 * gathered
    assert activation_bytes(config, MODEL_7B, "full", "tpu") == expected
    # About half of one device's: the share of the tokens, plus the whole row's keys and values of one layer.
    whole = activation_bytes(_config(*LONG_ROWS), MODEL_7B, "full", "tpu")
    assert 0.5 < expected / whole < 0.52


@pytest.mark.parametrize("ways", [2, 4, 8])
def test_every_policy_falls_close_to_one_over_context(ways):
    one = plan.activations_by_policy(_config(*LONG_ROWS), MODEL_7B, "tpu")
    split = plan.activations_by_policy(_config(*LONG_ROWS, f"mesh.context={ways}"), MODEL_7B, "tpu")
    for policy, size in one.items():
        assert 1 / ways < split[policy] / size < 1.1 / ways + 0.01, (policy, ways)


def test_the_split_sends_the_other_ways_keys_and_values_every_layer():
    """Forward: (C - 1) / C of the row's keys and values per layer; backward at most twice that; a step both, over
    the layers and micro-batches."""
    S, C, H, a, L = 1024 + 32768 - 1, 4, 128, 2, 28
    traffic = ctx.context_traffic(_config(*LONG_ROWS, "mesh.context=4"), MODEL_7B)
    forward = 2 * S * C * H * a * 3 // 4
    assert traffic == {"forward_per_layer": forward, "backward_per_layer": 2 * forward,
                       "per_step": 3 * forward * L * 4}
    assert ctx.context_traffic(_config(*LONG_ROWS), MODEL_7B)["per_step"] == 0


def test_the_issues_7b_at_32k_on_v5e_is_advised_a_context_size_that_fits():
    """Before mesh.context the plan's only advice was shorter answers or mesh.tensor; now it names a context size,
    and the config it names plans to fit on its own."""
    result = _plan(*LONG_ROWS, device="v5e")
    assert not result["fits"]["trainer"]
    assert round(result["trainer"]["activations"] / GIB, 2) == 16.09
    assert round(result["trainer"]["total"] / GIB, 2) == 19.50
    table = result["trainer"]["context_table"]
    assert table[0]["context"] == 1 and table[0]["total"] == result["trainer"]["total"]  # the table's C = 1 is the plan
    assert [r["context"] for r in table if r["devices"] == 32] == [1, 2, 4, 8, 16, 32]
    advice = [line for line in result["advice"] if "mesh.context=" in line]
    assert len(advice) == 1
    # the same 32 devices: a context way takes an fsdp way, and the state still splits 32 ways (fsdp x context)
    assert advice[0].startswith("trainer: mesh.context=2 with mesh.data=1 mesh.fsdp=16 train.micro_batches=8")
    advised = _plan(*LONG_ROWS, "mesh.context=2", "mesh.fsdp=16", "train.micro_batches=8", device="v5e")
    assert advised["fits"]["trainer"]
    assert advised["trainer"]["params"] == result["trainer"]["params"]  # fsdp x context = 32 ways, as fsdp was
    row = next(r for r in table if (r["context"], r["devices"]) == (2, 32))
    assert row["fits"] and row["total"] == advised["trainer"]["total"]
    assert f"{advised['trainer']['total'] / GIB:.2f} GiB per device" in advice[0]
    assert row["traffic_per_layer"] == advised["trainer"]["context_traffic"]["forward_per_layer"]


def test_the_same_devices_keep_each_devices_rows_and_grow_the_micro_batches():
    config = _config(*LONG_ROWS)
    for ways in (2, 4, 8):
        candidate = ctx.same_devices(config, ways)
        assert candidate is not None
        m = candidate.mesh
        assert (m.context, m.devices, m.fsdp) == (ways, 32, 32 // ways)
        assert candidate.train.micro_batches == 4 * ways
        assert rows_per_device(candidate) == rows_per_device(config) == 1
    assert ctx.same_devices(config, 64) is None  # more context ways than devices
    more = ctx.more_devices(config, 4)
    assert more is not None and (more.mesh.fsdp, more.mesh.context, more.mesh.devices) == (32, 4, 128)


def test_the_advice_prefers_the_same_devices_and_says_none_when_nothing_fits():
    config = _config(*LONG_ROWS)

    def row(context, devices, fits, total=10 * GIB):
        fsdp = devices // context if devices == 32 else 32  # the same devices shrink fsdp, more devices keep it
        return {"context": context, "data": 1, "fsdp": fsdp, "tensor": 1, "devices": devices,
                "micro_batches": 4 * 32 // fsdp, "total": total, "fits": fits}

    table = [row(1, 32, False), row(2, 64, True), row(4, 32, True), row(4, 128, True)]
    assert ctx.context_advice(config, table).startswith("mesh.context=4 with mesh.data=1 mesh.fsdp=8 "
                                                        "train.micro_batches=16: each row's tokens split 4 ways")
    assert "on the same 32 devices" in ctx.context_advice(config, table)
    assert ctx.context_advice(config, [row(1, 32, False), row(2, 64, False)]) is None


def test_a_plan_that_fits_has_no_table_and_the_text_shows_the_split():
    fits = _plan(*LONG_ROWS, "mesh.context=2", device="v5p")
    assert fits["fits"]["trainer"] and fits["trainer"]["context_table"] is None
    assert fits["mesh"]["context"] == 2 and fits["mesh"]["devices"] == 64
    assert fits["trainer"]["tokens_per_device"] == 16896
    text = report.format_text(fits)
    assert "mesh: data=1 fsdp=32 tensor=1 context=2 -> 64 devices" in text
    assert "of 33791 tokens per micro-batch, 16896 of each on a device: mesh.context=2 splits the tokens" in text
    assert "context split, received per device: keys and values 33.0 MiB per layer forward" in text

    tight = report.format_text(_plan(*LONG_ROWS, device="v5e"))
    assert "trainer per device by mesh.context (the same devices, or more):" in tight
    assert "          2    1   16      1      32     8     8.18 GiB  11.58 GiB      33.0 MiB  fits" in tight
    assert "      2    1   32      1      64     4     8.18 GiB   9.99 GiB      33.0 MiB  fits" in tight
    assert "change trainer: mesh.context=2 with mesh.data=1 mesh.fsdp=16 train.micro_batches=8" in tight


@pytest.mark.parametrize("name, device, alone", [
    ("qwen2.5_math_7b_dr_grpo_16k_v5p64.yaml", "v5p", ["mesh.fsdp=32", "mesh.context=1", "train.micro_batches=4"]),
    ("qwen2.5_math_7b_dr_grpo_16k_8xh100.yaml", "h100", ["mesh.fsdp=8", "mesh.context=1", "train.micro_batches=16"]),
])
def test_the_16k_recipes_state_the_plans_split_and_what_it_saves(name, device, alone):
    """The 16k recipes' headers: the rows and the split they plan, its traffic, and the figure without the split
    that says why mesh.context is set (test_plan.py checks their trainer and service totals)."""
    path = os.path.join(REPO, "configs", "recipes", name)
    header = open(path).read()
    config = cli._load(path, [])[0]
    assert config.mesh.context == 2 and config.rollout.max_prompt_tokens + config.rollout.max_new_tokens == 16384
    spec = device_spec(device)
    result = plan.make_plan(config, MODEL_7B, device=spec, serve_batch_size=32)
    assert result["fits"]["trainer"] and result["trainer"]["rows_per_device"] == 1
    traffic = result["trainer"]["context_traffic"]
    assert (f"The split receives {traffic['forward_per_layer'] / 2**20:.1f} MiB of keys and values per layer forward "
            f"(at most twice that backward), {traffic['per_step'] / GIB:.2f} GiB a step.") in header
    without = plan.make_plan(cli._load(path, alone)[0], MODEL_7B, device=spec, serve_batch_size=32)
    assert without["mesh"]["devices"] == result["mesh"]["devices"]
    assert f"{without['trainer']['total'] / GIB:.2f} GiB a " in header
    assert " ".join(alone) in header
    if device == "v5p":  # without the split, nothing recomputed does not fit
        assert config.model.remat == "none" and not without["fits"]["trainer"]
    else:  # the same policy fits without it, this close to the limit
        margin = (without["device"]["usable_bytes"] - without["trainer"]["total"]) / GIB
        assert f"{margin:.2f} GiB from the limit" in header and without["fits"]["trainer"]


def test_the_long_responses_page_quotes_the_plans_table_and_advice():
    """docs/long_responses.md#context-parallelism: its command's output holds every line the page quotes."""
    page = open(os.path.join(REPO, "docs", "long_responses.md")).read()
    section = page.split("## Context parallelism", 1)[1].split("\n## ", 1)[0]
    command, quoted = section.split("```bash\n", 1)[1].split("```", 1)
    assert "--device v5e rollout.max_new_tokens=32768 train.micro_batches=4" in command.replace("\\\n    ", "")
    text = report.format_text(_plan(*LONG_ROWS, device="v5e"))
    lines = quoted.split("```\n", 1)[1].split("```", 1)[0].strip("\n").splitlines()
    assert len(lines) == 5
    for line in lines:
        assert line in text.splitlines(), line


def test_a_context_size_whose_state_split_does_not_divide_the_model_is_refused_and_left_out_of_the_table():
    """The state splits its model dim over fsdp x context: 3,584 does not split 1,024 ways (the plan's one-line
    error names mesh.context), and the table skips such sizes rather than failing."""
    with pytest.raises(ConfigError, match=r"^mesh.context: .*dimension 'embed' of size 3584 is not divisible by mesh "
                                          r"axes \('fsdp', 'context'\) \(1024 ways\)$") as info:
        _plan(*LONG_ROWS, "mesh.context=32")  # fsdp 32 x context 32
    assert info.value.key == "mesh.context"
    table = _plan(*LONG_ROWS, device="v5e")["trainer"]["context_table"]
    assert max(r["fsdp"] * r["context"] for r in table) == 512  # 32 x 16; 32 x 32 does not divide 3,584
