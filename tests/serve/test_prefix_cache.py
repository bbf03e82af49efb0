"""Issue #65: the prefix cache (serve/prefix_cache.py over sampler/prefix_pool.py). With it, every row samples the
tokens and log-probs it samples without it (same seeds): a prompt asked again, a shared few-shot prefix with other
tails, an episode's next turn (its prompt = the last turn's prompt + completion + new text), after evictions under
a tiny budget and after a weight push (no block of version v is read at v + 1). Its memory is a fixed pool within
--prefix-cache-bytes, and /flush_cache and /get_model_info speak SGLang's words."""

import threading

import numpy as np
import pytest
from fastapi.testclient import TestClient

from drgrpo_jax.config.serve import ServeConfig
from drgrpo_jax.sampler.batch import RowRequest, SamplingParams
from drgrpo_jax.sampler.prefix_pool import BLOCK_TOKENS
from drgrpo_jax.serve.app import build_app
from drgrpo_jax.serve.native_routes import FLUSHED
from drgrpo_jax.serve.scheduler import Scheduler

from support.tiny_models import write_tiny_llama

pytestmark = pytest.mark.heavy  # schedulers compile the sampler's programs

FEW_SHOT = tuple(3 + (5 * i) % 47 for i in range(40))  # a shared 40-token prefix: 2 whole blocks of 16
PARAMS = SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    return write_tiny_llama(str(root / "v0"), seed=0), write_tiny_llama(str(root / "v1"), seed=1)


def _scheduler(model: str, cache_bytes: int) -> Scheduler:
    return Scheduler(ServeConfig(model=model, short_request_tokens=0, batch_wait_ms=1.0,
                                 prefix_cache_bytes=cache_bytes))


@pytest.fixture(scope="module")
def plain(folders):
    scheduler = _scheduler(folders[0], 0)
    yield scheduler
    scheduler.close()


@pytest.fixture(scope="module")
def cached(folders):
    scheduler = _scheduler(folders[0], 2**20)
    yield scheduler
    scheduler.close()


def _rows(prompt, seed: int, n: int = 2) -> list[RowRequest]:
    return [RowRequest(tuple(prompt), PARAMS, seed=seed, sample=k) for k in range(n)]


def _same(scheduler: Scheduler, oracle: Scheduler, rows: list[RowRequest]) -> list:
    """Samples `rows` on both; asserts equal tokens and log-probs; returns `scheduler`'s results."""
    got = scheduler.submit(rows).result(timeout=300)
    want = oracle.submit(rows).result(timeout=300)
    for mine, theirs in zip(got, want):
        assert mine.output_ids == theirs.output_ids
        np.testing.assert_allclose(mine.logprobs, theirs.logprobs, atol=1e-5)
    return got


def test_cached_prefixes_sample_what_whole_prompts_do(cached, plain):
    cached.prefix_cache.flush()
    first = FEW_SHOT + (7, 8, 9, 10, 11)
    assert [r.cached_tokens for r in _same(cached, plain, _rows(first, seed=1))] == [0, 0]
    # The same prompt again (another request, other seeds): its 2 whole blocks come from the cache.
    again = _same(cached, plain, _rows(first, seed=2))
    assert [r.cached_tokens for r in again] == [2 * BLOCK_TOKENS] * 2
    # The shared few-shot prefix with another tail: blocks 0 and 1 are the prefix's.
    other = _same(cached, plain, _rows(FEW_SHOT + (20, 21, 22), seed=3))
    assert [r.cached_tokens for r in other] == [2 * BLOCK_TOKENS] * 2
    # An episode's next turn: the first turn's prompt, its completion and new text.
    turn2 = first + tuple(again[0].output_ids) + (30, 31, 32)
    (episode,) = _same(cached, plain, _rows(turn2, seed=4, n=1))
    assert episode.cached_tokens == 2 * BLOCK_TOKENS  # the first turn's prompt blocks
    (turn3,) = _same(cached, plain, _rows(turn2 + (40,), seed=5, n=1))
    assert turn3.cached_tokens == (len(turn2) // BLOCK_TOKENS) * BLOCK_TOKENS  # turn 2's own blocks now too
    stats = cached.prefix_stats()
    assert stats["hit_tokens"] == 2 * BLOCK_TOKENS * 3 + turn3.cached_tokens  # each distinct prompt counted once
    # Every batch's distinct prompt tokens were either read from the cache or prefilled.
    assert stats["hit_tokens"] + stats["miss_tokens"] == 2 * len(first) + len(FEW_SHOT) + 3 + 2 * len(turn2) + 1


def test_a_prompt_reads_cached_blocks_only_into_the_room_its_bucket_leaves(cached, plain):
    """A prompt's slots stay the power of two of its whole length; the rest it prefills takes its own power of two,
    and the cached blocks fit in what is left: a 59-token prompt (64 slots) whose 43-token rest also needs 64 reads
    none of its cached block, while the same block serves a 40-token prompt (64 slots, a 24-token rest in 32)."""
    cached.prefix_cache.flush()
    opening = FEW_SHOT[:23]
    _same(cached, plain, _rows(opening, seed=6, n=1))  # keeps its one whole block
    (short,) = _same(cached, plain, _rows(opening + tuple(range(50, 67)), seed=7, n=1))
    assert short.cached_tokens == BLOCK_TOKENS
    (long,) = _same(cached, plain, _rows(opening + tuple(range(70, 106)), seed=8, n=1))
    assert long.cached_tokens == 0


@pytest.mark.parametrize("capacity, bursts", [(3, 5), (20, 12)])  # 20: the pool grows from 16 blocks to 20
def test_a_burst_of_distinct_prompts_evicts_and_stays_within_the_budget(folders, plain, capacity, bursts):
    probe = _scheduler(folders[0], 2**20)
    block = probe.prefix_cache.block_bytes
    probe.close()
    budget = (capacity + 1) * block  # the blocks and the pool's scratch one
    small = _scheduler(folders[0], budget)
    try:
        assert small.prefix_cache.capacity == capacity
        # A burst of distinct 40-token prompts (2 whole blocks each), then the first ones again.
        prompts = [tuple(3 + (i * 7 + j) % 47 for j in range(40)) for i in range(bursts)]
        for i, prompt in enumerate(prompts + prompts[:2]):
            _same(small, plain, _rows(prompt, seed=10 + i, n=1))
            assert small.prefix_stats()["cached_blocks"] <= capacity
        stats = small.prefix_stats()
        assert stats["evicted_blocks"] >= 2 * bursts - capacity and stats["budget_bytes"] == budget
        pool = small.prefix_cache._pool
        assert pool is not None and pool.k.nbytes + pool.v.nbytes == budget == stats["pool_bytes"]
    finally:
        small.close()


def test_a_weight_push_never_reads_the_old_versions_blocks(folders):
    cached = _scheduler(folders[0], 2**20)
    fresh_v1 = _scheduler(folders[1], 0)
    try:
        prompt = FEW_SHOT + (7, 8)
        cached.submit(_rows(prompt, seed=1)).result(timeout=300)
        assert cached.prefix_stats()["cached_blocks"] == 2
        cached.served.load_folder(folders[1], "1")
        after = _same(cached, fresh_v1, _rows(prompt, seed=2))
        assert [r.cached_tokens for r in after] == [0, 0] and after[0].weight_version == "1"
        again = _same(cached, fresh_v1, _rows(prompt, seed=3))  # version 1's own blocks serve it
        assert [r.cached_tokens for r in again] == [2 * BLOCK_TOKENS] * 2
    finally:
        cached.close()
        fresh_v1.close()


def test_flush_cache_and_the_counters_over_http(cached):
    client = TestClient(build_app(cached), base_url="http://localhost")
    cached.submit(_rows(FEW_SHOT + (9,), seed=1)).result(timeout=300)
    info = client.get("/get_model_info").json()["prefix_cache"]
    assert set(info) >= {"hit_tokens", "miss_tokens", "evicted_blocks", "cached_blocks", "budget_bytes", "pool_bytes"}
    assert info["cached_blocks"] >= 2 and info["budget_bytes"] == 2**20
    answer = client.post("/flush_cache")
    assert answer.status_code == 200 and answer.text == FLUSHED
    assert client.get("/get_model_info").json()["prefix_cache"]["cached_blocks"] == 0
    body = client.post("/generate", json={"input_ids": list(FEW_SHOT + (9,)), "sampling_params": {
        "max_new_tokens": 4}}).json()
    assert body["meta_info"]["cached_tokens"] == 0  # flushed: prefilled whole, and kept again
    body = client.post("/generate", json={"input_ids": list(FEW_SHOT + (9,)), "sampling_params": {
        "max_new_tokens": 4}}).json()
    assert body["meta_info"]["cached_tokens"] == 2 * BLOCK_TOKENS


def test_flush_cache_is_refused_while_a_request_runs(cached):
    started, release = threading.Event(), threading.Event()
    real = cached.run_batch

    def held(weights, rows, unwanted=None):
        started.set()
        release.wait(60)
        return real(weights, rows, unwanted=unwanted)

    cached.run_batch = held  # type: ignore[method-assign]
    try:
        future = cached.submit(_rows(FEW_SHOT, seed=1, n=1))
        assert started.wait(60)
        client = TestClient(build_app(cached), base_url="http://localhost")
        refused = client.post("/flush_cache")
        assert refused.status_code == 400 and "running" in refused.text
    finally:
        release.set()
        cached.run_batch = real  # type: ignore[method-assign]
    future.result(timeout=300)
    assert cached.flush_cache()


def test_the_budget_flag_is_checked(folders):
    with pytest.raises(ValueError, match="prefix_cache_bytes: must be >= 0, or -1"):
        ServeConfig(model="m", prefix_cache_bytes=-2)
    with pytest.raises(ValueError, match="--prefix-cache-bytes: 100 bytes hold no block"):
        _scheduler(folders[0], 100)


def test_a_cached_prefix_on_a_mesh_samples_what_one_device_does(tmp_path):
    folder = write_tiny_llama(str(tmp_path / "even"), vocab_size=64)  # a vocabulary that splits over tensor=2
    meshed = Scheduler(ServeConfig(model=folder, mesh="tensor=2,data=2", short_request_tokens=0,
                                   batch_wait_ms=1.0, prefix_cache_bytes=2**20))
    one = _scheduler(folder, 0)
    try:
        for seed, tail in enumerate([(7, 8), (7, 8), (20, 21, 22)]):
            results = _same(meshed, one, _rows(FEW_SHOT + tail, seed=seed))
            assert [r.cached_tokens for r in results] == [0 if seed == 0 else 2 * BLOCK_TOKENS] * 2
    finally:
        meshed.close()
        one.close()
