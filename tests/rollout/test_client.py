"""The rollout client: retries, failover, version checks, assembly, and the local child-process mode."""

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import numpy as np
import pytest

from drgrpo_jax.errors import RolloutError, StaleWeightsError
from drgrpo_jax.rollout.client import RolloutClient, check_versions, retryable
from drgrpo_jax.rollout.local_service import LocalServer
from drgrpo_jax.seeds import prompt_seeds


def fake_generate(request: httpx.Request, version: str = "3") -> httpx.Response:
    """An SGLang-shaped /generate answer whose tokens encode (prompt's first id, seed, sample)."""
    body = json.loads(request.content)
    items = []
    for prompt, params in zip(body["input_ids"], body["sampling_params"]):
        for j in range(params["n"]):
            ids = [prompt[0], params["sampling_seed"] % 1000, j][:params["max_new_tokens"]]
            items.append({"output_ids": ids, "meta_info": {
                "output_token_logprobs": [[-0.5 * (k + 1), t, None] for k, t in enumerate(ids)],
                "finish_reason": {"type": "length", "length": len(ids)} if j else {"type": "stop", "matched": ids[-1]},
                "weight_version": version}})
    return httpx.Response(200, json=items)


def client_with(handler, urls=("http://a",), **kwargs) -> RolloutClient:
    """A client of fake services that answer /generate alone: the vocabulary is given, as the trainer gives it."""
    return RolloutClient(list(urls), transport=httpx.MockTransport(handler), backoff_s=0.0,
                         **{"vocab_size": 1000, **kwargs})


PROMPTS = [[10, 1], [20, 2, 2], [30], [40, 4]]


def test_rollout_is_prompt_major_padded_and_aligned():
    with client_with(fake_generate) as client:
        sampled = client.generate(PROMPTS, 2, max_new_tokens=5, seed=0)
    assert sampled.response_ids.shape == (8, 5) and sampled.group_size == 2
    np.testing.assert_array_equal(sampled.response_ids[:, 0], [10, 10, 20, 20, 30, 30, 40, 40])
    np.testing.assert_array_equal(sampled.response_ids[:, 2], [0, 1] * 4)
    assert sampled.lengths.tolist() == [3] * 8 and sampled.response_mask.sum() == 24
    np.testing.assert_array_equal(sampled.behaviour_logprobs[0], [-0.5, -1.0, -1.5, 0, 0])
    assert sampled.truncated.tolist() == [False, True] * 4
    assert sampled.weight_versions == ("3",) * 8


def test_ignore_eos_is_sent_only_when_asked():
    """rollout.ignore_eos reaches the service as SGLang's sampling parameter; other bodies stay as they were."""
    bodies = []

    def handler(request):
        bodies.append(json.loads(request.content))
        return fake_generate(request)

    with client_with(handler) as client:
        client.generate(PROMPTS[:2], 2, max_new_tokens=4, seed=0, stop_token_ids=[2])
        client.generate(PROMPTS[:2], 2, max_new_tokens=4, seed=0, ignore_eos=True)
    assert [p.get("ignore_eos") for p in bodies[0]["sampling_params"]] == [None, None]
    assert [p["stop_token_ids"] for p in bodies[0]["sampling_params"]] == [[2], [2]]
    assert [(p["ignore_eos"], p["stop_token_ids"]) for p in bodies[1]["sampling_params"]] == [(True, [])] * 2


def test_seeds_do_not_depend_on_how_the_fleet_splits_prompts():
    with client_with(fake_generate) as one, client_with(fake_generate, ["http://a", "http://b", "http://c"]) as three:
        a = one.generate(PROMPTS, 3, max_new_tokens=4, seed=5)
        b = three.generate(PROMPTS, 3, max_new_tokens=4, seed=5)
        c = one.generate(PROMPTS, 3, max_new_tokens=4, seed=6)
    np.testing.assert_array_equal(a.response_ids, b.response_ids)
    assert not np.array_equal(a.response_ids, c.response_ids)
    assert len(set(prompt_seeds(5, 4))) == 4 and prompt_seeds(5, 2, offset=2) == prompt_seeds(5, 4)[2:]


def test_the_fleet_shares_prompts_by_whole_groups():
    seen = []

    def handler(request):
        seen.append((request.url.host, len(json.loads(request.content)["input_ids"])))
        return fake_generate(request)

    with client_with(handler, ["http://a", "http://b"]) as client:
        client.generate(PROMPTS, 2, max_new_tokens=3, seed=0)
    assert sorted(seen) == [("a", 2), ("b", 2)]


def test_a_hosts_share_samples_as_the_whole_rollout_does():
    """Host h sends prompts[a:b] with prompt_offset=a: the same seeds, so the same completions, as one client."""
    seen = []

    def handler(request):
        seen.append((request.url.host, json.loads(request.content)["input_ids"][0][0]))
        return fake_generate(request)

    with client_with(handler, ["http://a", "http://b"]) as client:
        whole = client.generate(PROMPTS, 2, max_new_tokens=3, seed=7)
        seen.clear()
        halves = [client.generate(PROMPTS[a:b], 2, max_new_tokens=3, seed=7, prompt_offset=a, first_url=h)
                  for h, (a, b) in enumerate([(0, 2), (2, 4)])]
    np.testing.assert_array_equal(np.concatenate([r.response_ids for r in halves]), whole.response_ids)
    # host 0 starts at URL a, host 1 at URL b: each service gets one prompt of each host
    assert sorted(seen) == [("a", 10), ("a", 40), ("b", 20), ("b", 30)]


def test_weights_go_to_every_url_and_each_refusal_is_named():
    pushed = []

    def handler(request):
        pushed.append(request.url.host)
        if request.url.host == "c":
            return httpx.Response(200, json={"success": False, "message": "no such folder"})
        if request.url.host == "d":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json={"success": True, "message": "ok"})

    with client_with(handler, ["http://a", "http://b"], max_retries=0) as client:
        client.update_weights("/w/v1", 1)
    assert sorted(pushed) == ["a", "b"]
    pushed.clear()
    with client_with(handler, ["http://a", "http://c", "http://d", "http://b"], max_retries=0) as client:
        with pytest.raises(RolloutError, match="not loaded by 2 of 4") as error:
            client.update_weights("/w/v2", 2)
    assert "http://c/update_weights_from_disk: no such folder" in str(error.value)
    assert "http://d/update_weights_from_disk" in str(error.value)
    assert sorted(pushed) == ["a", "b", "c", "d"]  # the healthy services still got the push


def test_transient_errors_are_retried_with_backoff():
    calls = []

    def handler(request):
        calls.append(request)
        if len(calls) == 1:
            raise httpx.ConnectError("refused", request=request)
        if len(calls) == 2:
            raise httpx.ReadTimeout("slow", request=request)
        if len(calls) == 3:
            return httpx.Response(503, json={"error": {"message": "busy"}})
        return fake_generate(request)

    with client_with(handler, max_retries=3) as client:
        assert client.generate(PROMPTS[:1], 1, max_new_tokens=3, seed=0).response_ids.shape == (1, 3)
    assert len(calls) == 4


def test_client_errors_are_not_retried_and_carry_the_message():
    calls = []

    def handler(request):
        calls.append(request)
        return httpx.Response(400, json={"error": {"message": "sampling_params.top_p: must be > 0"}})

    with client_with(handler, ["http://a", "http://b"], max_retries=3) as client:
        with pytest.raises(RolloutError, match="HTTP 400: sampling_params.top_p") as error:
            client.generate(PROMPTS[:1], 1, max_new_tokens=3)
    assert len(calls) == 1  # neither retried on http://a nor failed over to http://b
    assert (error.value.status, error.value.url) == (400, "http://a")


def test_a_url_that_keeps_answering_429_fails_over_to_the_next():
    calls = []

    def handler(request):
        calls.append(request.url.host)
        if request.url.host == "busy":
            return httpx.Response(429, json={"error": {"message": "too many requests"}})
        return fake_generate(request)

    with client_with(handler, ["http://busy", "http://ok"], max_retries=2) as client:
        sampled = client.generate(PROMPTS, 1, max_new_tokens=3, seed=0, first_url=0)
    np.testing.assert_array_equal(sampled.response_ids[:, 0], [10, 20, 30, 40])
    assert calls.count("busy") == 3  # the first share: 1 + 2 retries on http://busy, then http://ok
    assert calls.count("ok") == 2  # its own share and the failed-over one
    with client_with(handler, ["http://busy"], max_retries=1) as client:
        with pytest.raises(RolloutError, match="failed after 2 attempts: .*HTTP 429") as error:
            client.generate(PROMPTS, 1, max_new_tokens=3)
    assert error.value.__cause__.status == 429


def test_retry_after_is_honoured_before_retrying():
    times = []

    def handler(request):
        times.append(time.monotonic())
        if len(times) == 1:
            return httpx.Response(429, headers={"Retry-After": "0.4"}, json={"error": {"message": "queue full"}})
        return fake_generate(request)

    with client_with(handler, max_retries=2) as client:  # backoff_s=0: only Retry-After makes it wait
        client.generate(PROMPTS[:1], 1, max_new_tokens=3, seed=0)
    assert len(times) == 2 and times[1] - times[0] >= 0.4


def test_the_api_key_goes_in_the_authorization_header():
    seen = []

    def handler(request):
        seen.append(request.headers.get("authorization"))
        return fake_generate(request)

    with RolloutClient(["http://a"], transport=httpx.MockTransport(handler), api_key="k3y", vocab_size=1000) as client:
        client.generate(PROMPTS[:1], 1, max_new_tokens=2, seed=0)
    assert seen == ["Bearer k3y"]


@pytest.mark.parametrize("status, expected", [(None, True), (500, True), (503, True), (429, True), (408, True),
                                              (400, False), (401, False), (404, False), (422, False)])
def test_failover_is_decided_on_the_status_code(status, expected):
    assert retryable(status) is expected


def test_a_dead_url_fails_over_and_all_dead_raises():
    def handler(request):
        if request.url.host == "dead":
            raise httpx.ConnectError("refused", request=request)
        return fake_generate(request)

    with client_with(handler, ["http://dead", "http://alive"], max_retries=1) as client:
        sampled = client.generate(PROMPTS, 1, max_new_tokens=3, seed=0)
    np.testing.assert_array_equal(sampled.response_ids[:, 0], [10, 20, 30, 40])
    with client_with(handler, ["http://dead"], max_retries=2) as client:
        with pytest.raises(RolloutError, match="failed after 3 attempts"):
            client.generate(PROMPTS, 1, max_new_tokens=3)


def test_weight_version_is_checked():
    with client_with(fake_generate) as client:
        client.generate(PROMPTS, 1, max_new_tokens=3, expected_version=3)
        with pytest.raises(StaleWeightsError, match="got '3', expected '4'"):
            client.generate(PROMPTS, 1, max_new_tokens=3, expected_version=4)
        client.generate(PROMPTS, 1, max_new_tokens=3, expected_version=4, max_staleness=1)
    check_versions(["7", "8"], 8, max_staleness=1)
    with pytest.raises(StaleWeightsError):
        check_versions(["6", "8"], 8, max_staleness=1)
    with pytest.raises(StaleWeightsError):
        check_versions([None], 0)


def test_misaligned_or_overlong_answers_are_refused():
    def misaligned(request):
        answer = fake_generate(request).json()
        answer[0]["meta_info"]["output_token_logprobs"] = answer[0]["meta_info"]["output_token_logprobs"][:-1]
        return httpx.Response(200, json=answer)

    with client_with(misaligned) as client, pytest.raises(RolloutError, match="not aligned"):
        client.generate(PROMPTS, 1, max_new_tokens=3)
    with client_with(lambda r: httpx.Response(200, json=[])) as client, pytest.raises(RolloutError, match="0 compl"):
        client.generate(PROMPTS, 1, max_new_tokens=3)


def test_the_seed_goes_by_sglangs_name():
    """SGLang builds SamplingParams(**sampling_params), whose seed field is `sampling_seed` (sgl-project/sglang
    python/sglang/srt/sampling/sampling_params.py): an unknown `seed` would raise there."""
    bodies = []

    def handler(request):
        bodies.append(json.loads(request.content))
        return fake_generate(request)

    with client_with(handler) as client:
        client.generate(PROMPTS, 2, max_new_tokens=3, seed=5)
    params = bodies[0]["sampling_params"]
    assert [p["sampling_seed"] for p in params] == prompt_seeds(5, len(PROMPTS))
    assert all("seed" not in p for p in params)


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf"), "x", -1.5e11 * 1e300, 0.5])
def test_missing_or_non_finite_logprobs_are_refused(bad):
    def handler(request):
        answer = json.loads(fake_generate(request).content)
        answer[1]["meta_info"]["output_token_logprobs"][1][0] = bad
        return httpx.Response(200, content=json.dumps(answer).encode())  # NaN and Infinity as Python writes them

    with client_with(handler) as client, \
            pytest.raises(RolloutError, match=r"^http://a/generate: \[1\]\.meta_info\.output_token_logprobs\[1\]: "):
        client.generate(PROMPTS, 2, max_new_tokens=5, seed=0)


def test_arguments_are_validated():
    with pytest.raises(ValueError, match="urls"):
        RolloutClient([])
    with client_with(fake_generate) as client:
        with pytest.raises(ValueError, match="group_size"):
            client.generate(PROMPTS, 0, max_new_tokens=3)


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model


@pytest.mark.subprocess  # the generation service as a child process
def test_local_server_round_trip_and_clean_stop(model_dir):
    with LocalServer(model_dir, weight_version=5) as server:
        pid = server._process.pid
        with RolloutClient([server.url]) as client, RolloutClient([server.url, server.url]) as fleet:
            assert client.healthy() == [True]
            sampled = client.generate(PROMPTS, 3, max_new_tokens=8, seed=1, expected_version=5)
            assert sampled.response_ids.shape == (12, 8) and sampled.weight_versions == ("5",) * 12
            mask = sampled.response_mask
            assert (sampled.behaviour_logprobs[mask] < 0).all() and (sampled.behaviour_logprobs[~mask] == 0).all()
            assert ((sampled.lengths == 8) | ~sampled.truncated).all()
            np.testing.assert_array_equal(sampled.response_ids,
                                          fleet.generate(PROMPTS, 3, max_new_tokens=8, seed=1).response_ids)
            client.update_weights(model_dir, 6)
            assert client.model_info()["weight_version"] == "6"
            # A URI (gs://... in a real run) is copied to a local temp folder first: file:// takes that path here.
            client.update_weights("file://" + os.path.abspath(model_dir), 8)
            info = client.model_info()
            assert info["weight_version"] == "8" and info["model_path"] == os.path.basename(model_dir)  # no path
            with pytest.raises(RolloutError, match="model_path"):
                client.update_weights("file://" + os.path.abspath(model_dir) + "/missing", 9)
            with pytest.raises(RolloutError, match="model_path: not a valid model folder"):
                client.update_weights(model_dir + "/missing", 9)
            with pytest.raises(RolloutError, match="weight_version: 7 is older than the served version 8"):
                client.update_weights(model_dir, 7)
            client.update_weights(model_dir, 7, rollback=True)  # a run resumed from its step-7 checkpoint
            assert client.model_info()["weight_version"] == "7"
        url = server.url
    assert server.stop() is None and not server.running  # already stopped by the with block
    assert process_gone(pid)
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=2.0)


@pytest.mark.subprocess  # the generation service as a child process
def test_local_server_reports_a_failed_start(tmp_path):
    with pytest.raises(RolloutError, match="exited with code") as error:
        LocalServer(str(tmp_path / "nothing"), startup_timeout_s=120).start()
    assert "nothing" in str(error.value)  # the child's log tail names the bad path


def process_gone(pid: int, timeout_s: float = 30.0) -> bool:
    """Whether pid has exited (a zombie waiting to be reaped counts as exited)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ", 1)[1].startswith("Z"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.subprocess  # the generation service as a child process
def test_the_service_exits_when_its_trainer_is_killed(model_dir):
    trainer = textwrap.dedent(f"""
        import os, signal, sys
        from drgrpo_jax.rollout.local_service import LocalServer
        server = LocalServer({model_dir!r})
        server.start()
        print(server._process.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no cleanup: only the child's watchdog can help
    """)
    result = subprocess.run([sys.executable, "-c", trainer], capture_output=True, text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert process_gone(int(result.stdout.split()[0]))


@pytest.mark.subprocess  # a generation service child process, killed and restarted
def test_a_killed_local_service_is_restarted_on_the_pushed_weights_and_the_rollout_redone(model_dir, tmp_path):
    """SIGKILL the child mid-rollout: the client restarts it on the last pushed version and redoes the request."""
    import concurrent.futures
    import shutil

    v1 = str(tmp_path / "weights" / "v1")
    shutil.copytree(model_dir, v1)
    env = {"ROLLOUT_TEST_KEY": "k-123"}
    with LocalServer(model_dir, env=env, api_key_env="ROLLOUT_TEST_KEY", weights_roots=[str(tmp_path / "weights")]
                     ) as server, RolloutClient([server.url], local_server=server, backoff_s=0.1,
                                                api_key="k-123") as client:
        client.update_weights(v1, 1)
        first_pid = server._process.pid
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            killed = pool.submit(client.generate, PROMPTS, 8, max_new_tokens=100, seed=3, expected_version=1)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # wait until the rollout is inside the service, then kill it
                info = httpx.get(server.url + "/get_model_info", headers={"Authorization": "Bearer k-123"}).json()
                if info["queued_tokens"] > 0:
                    break
                time.sleep(0.02)
            assert info["queued_tokens"] > 0, "the rollout never reached the service"
            os.kill(first_pid, signal.SIGKILL)
            redone = killed.result(timeout=600)
        assert client.service_restarts == 1 and server._process.pid != first_pid
        assert client.model_info()["weight_version"] == "1"
        again = client.generate(PROMPTS, 8, max_new_tokens=100, seed=3, expected_version=1)
        np.testing.assert_array_equal(redone.response_ids, again.response_ids)  # the redone request samples the same
        # Killed between steps: the next push restarts it directly on the pushed weights.
        os.kill(server._process.pid, signal.SIGKILL)
        server._process.wait()
        client.update_weights(v1, 2)
        assert client.service_restarts == 2 and client.model_info()["weight_version"] == "2"


def test_two_threads_finding_the_child_dead_restart_it_once_and_both_redo_their_requests():
    """A round samples while the update loop pushes (rollout.inflight_updates): both may find the child dead."""

    class DeadChild:  # what RolloutClient reads of a LocalServer
        model, weight_version, returncode, url = "m", "0", -9, "http://127.0.0.1:1"
        running, starts = False, 0

        def stop(self) -> None:
            pass

        def start(self) -> str:
            time.sleep(0.2)  # the other thread arrives meanwhile
            self.starts += 1
            self.running, self.url = True, "http://127.0.0.1:2"
            return self.url

    child = DeadChild()
    with RolloutClient([child.url], local_server=child) as client:  # type: ignore[arg-type]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both requests failed before any restart
            answers = sorted(pool.map(client._restart_local_server, [0, 0]))
        assert answers == ["by_another", "restarted"] and child.starts == 1 and client.service_restarts == 1
        assert client.urls == ("http://127.0.0.1:2",)
        assert client._restart_local_server(1) == ""  # running, and nobody restarted it since that request
