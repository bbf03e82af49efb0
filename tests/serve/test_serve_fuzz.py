"""Property-based API fuzz (hypothesis) over the service's /openapi.json, with its keys set: no input gives a 5xx,
every error is in OpenAI's shape, no answer comes later than the request deadline, and the service stays healthy."""

import json
import os
import time

import httpx
import hypothesis  # the dev extra installs it: a missing hypothesis is a failure, not a skip
import hypothesis.strategies as st
import pytest

from drgrpo_jax.rollout.local_service import LocalServer

from support.tiny_models import write_tiny_llama

pytestmark = pytest.mark.subprocess  # a real service child process

KEY = "fuzz-key"
ADMIN_KEY = "fuzz-admin-key"
EXAMPLES_PER_ROUTE = 60
ANSWERS = {200, 400, 401, 403, 413, 429}  # everything else (5xx above all) is a defect
DEADLINE_S = 20.0  # --request-timeout-s: no answer may come later (plus the transfer's slack)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    model = write_tiny_llama(str(root / "model"), max_position_embeddings=64)
    (root / "weights").mkdir()
    with LocalServer(model, env={"FUZZ_KEY": KEY, "FUZZ_ADMIN_KEY": ADMIN_KEY}, api_key_env="FUZZ_KEY",
                     weights_roots=[str(root / "weights")],
                     extra_args=["--admin-key-env", "FUZZ_ADMIN_KEY", "--max-batch-size", "8",
                                 "--max-request-tokens", "2048", "--max-queued-tokens", "8192",
                                 "--max-body-bytes", "200000", "--request-timeout-s", str(DEADLINE_S)]) as server:
        yield server


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def _request_schema(spec: dict, path: str) -> dict:
    ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return spec["components"]["schemas"][ref.rsplit("/", 1)[1]]


def _values() -> st.SearchStrategy:
    """JSON values biased to the edges: int32/int64 limits, huge and tiny floats, surrogates, long and nested."""
    edges = st.sampled_from([0, 1, -1, 2, 63, 64, 2**31 - 1, 2**31, 2**32, 2**63, -2**63, 10**30, 0.0, 1e-300,
                             1e300, 0.5, -0.5, "", "\ud800", "x" * 5000, True, False, None])
    ids = st.lists(st.integers(-3, 70), max_size=40)
    leaves = st.one_of(edges, st.integers(), st.floats(allow_nan=False), st.text(max_size=50), ids,
                       st.lists(ids, max_size=4))
    return st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                        max_leaves=12)


VALID = {  # one body per route that the service answers with 200; the fuzz mutates up to three of its fields
    "/generate": {"input_ids": [[5, 9, 3]], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}},
    "/v1/completions": {"prompt": "hi there", "max_tokens": 4},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},  # no template: 400
    "/update_weights_from_disk": {"model_path": "/nowhere", "weight_version": "1"},
    "/update_weights_from_tensor": {"segment": "drgrpo_weights_1_abcdefgh/v1_0123456789abcdef",  # none such: 400
                                    "weight_version": "1",
                                    "tensors": [{"name": "embed", "dtype": "float32", "shape": [1], "offset": 0}]},
}


def _bodies(spec: dict, path: str) -> st.SearchStrategy:
    """Random objects of the route's field names, and valid bodies with a few fields changed to any value."""
    fields = list(_request_schema(spec, path)["properties"])
    params = list(spec["components"]["schemas"]["SamplingParamsIn"]["properties"])
    sampling = st.dictionaries(st.sampled_from(params), _values(), max_size=len(params))
    value_of = {name: (st.one_of(sampling, st.lists(sampling, max_size=3)) if name == "sampling_params"
                       else _values()) for name in fields}
    random_objects = st.fixed_dictionaries({}, optional={**value_of, "bogus": _values()})
    plausible = st.one_of(_values(), st.integers(0, 40), st.floats(0, 2), st.text(max_size=20),
                          st.lists(st.lists(st.integers(0, 45), min_size=1, max_size=8), min_size=1, max_size=3))
    keys = fields + ([f"sampling_params.{p}" for p in params] if path == "/generate" else [])
    changes = st.lists(st.tuples(st.sampled_from(keys), plausible), max_size=3)

    def mutate(edits: list) -> dict:
        body = json.loads(json.dumps(VALID[path]))
        for key, value in edits:
            outer, _, inner = key.partition(".")
            if inner and isinstance(body.get(outer), dict):
                body[outer][inner] = value
            elif not inner:
                body[outer] = value
        return body

    return st.one_of(random_objects, changes.map(mutate))


def _assert_openai_error(response: httpx.Response, context) -> None:
    """An error body a client can read: OpenAI's {"error": {"message", "type", "code"}}, never a stack trace."""
    error = response.json().get("error")
    assert isinstance(error, dict) and isinstance(error.get("message"), str) and error.get("type"), (
        context, response.status_code, response.text[:500])


def _fuzz(client: httpx.Client, url: str, bodies: st.SearchStrategy, headers: dict, seen: set[int]) -> None:
    """EXAMPLES_PER_ROUTE bodies POSTed to url (one in ten with a wrong or no key); every answer in ANSWERS, in
    time, errors in OpenAI's shape."""
    wrong = [{"content-type": "application/json"}, {**headers, "Authorization": "Bearer wrong"}]

    @hypothesis.settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(body=bodies, keyed=st.sampled_from([0] * 9 + [1, 2]))
    def check(body, keyed):
        content = json.dumps(body).encode()  # lone surrogates travel as \ud800 escapes, as JSON allows
        start = time.monotonic()
        response = client.post(url, content=content, headers=headers if keyed == 0 else wrong[keyed - 1])
        elapsed = time.monotonic() - start
        seen.add(response.status_code)
        assert response.status_code in ANSWERS, (url, body, response.status_code, response.text[:500])
        assert elapsed < DEADLINE_S + 10, (url, body, elapsed)
        if response.status_code >= 400:
            _assert_openai_error(response, (url, body))

    check()


def _fuzz_paths(client: httpx.Client, url: str, headers: dict) -> None:
    """Unknown routes and wrong methods: 404 and 405, in OpenAI's shape."""
    @hypothesis.settings(max_examples=30, deadline=None, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(path=st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="?#%"),
                                   min_size=1, max_size=30),
                      method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]))
    def check(path, method):
        response = client.request(method, url + "/nowhere/" + path, headers=headers)
        assert response.status_code in (404, 405), (path, method, response.status_code, response.text[:300])
        _assert_openai_error(response, (path, method))

    check()
    for method in ("PUT", "DELETE"):
        response = client.request(method, url + "/generate", headers=headers)
        assert response.status_code == 405, response.text
        _assert_openai_error(response, method)


@pytest.mark.slow  # 5 routes x 60 examples through a real service child process (~1 min on 2 busy cores)
def test_fuzzed_requests_never_get_5xx_and_the_service_stays_healthy(service):
    headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    spec = httpx.get(service.url + "/openapi.json", headers=headers, timeout=30).json()
    routes = [path for path, ops in spec["paths"].items() if "post" in ops]
    assert set(routes) >= {"/generate", "/v1/completions", "/update_weights_from_disk"}
    rss_before = _rss_mb(service._process.pid)
    seen: dict[str, set[int]] = {}
    admin = {**headers, "Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(timeout=120) as client:
        for path in routes:
            keyed = admin if path.startswith("/update_weights") else headers
            _fuzz(client, service.url + path, _bodies(spec, path), keyed, seen.setdefault(path, set()))
        _fuzz_paths(client, service.url, headers)
        for path, ops in spec["paths"].items():
            if "get" in ops:
                assert client.get(service.url + path, headers=headers).status_code == 200, path
    assert all(codes & {400, 403} for codes in seen.values()), seen  # the fuzz reached the validation
    assert 200 in seen["/generate"] and 200 in seen["/v1/completions"], seen  # and the sampler
    assert httpx.get(service.url + "/health", timeout=30).status_code == 200
    assert _rss_mb(service._process.pid) < rss_before + 1500, "service memory grew under the fuzz"
    assert os.path.exists(service.log_path) and "Traceback" not in open(service.log_path).read()
