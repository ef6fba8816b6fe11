"""The API around generation: served model names (/v1/models, 404 for another model),
unknown routes and methods in the OpenAI error shape, HEAD, /tokenize, /detokenize,
/version, and the `priority` field reaching the decode worker. No model runs."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from cluster.config import ClusterConfig, ConfigError
from cluster.serve import router_for
from router.app import create_app
from tests.http_server import free_port, serving
from tests.unit.test_router_http import FakeDecodeWorker, open_request, request, slow_tokenizer

NAMES = ["tiny-llama", "alias"]
KEY = "sk-surface-0123456789"
REPO = Path(__file__).resolve().parents[2]


def app_with(llama_dir: Path, **router: object) -> TestClient:
    config = ClusterConfig.from_dict({"model": str(llama_dir), "prefill": {"replicas": 0}, "router": router})
    # A worker address nobody listens on: these requests never reach a worker.
    return TestClient(create_app(router_for(config, {"decode-0": "tcp://127.0.0.1:9"})))


@pytest.fixture(scope="module")
def http(llama_dir: Path) -> Iterator[TestClient]:
    with app_with(llama_dir, served_model_name=NAMES) as client:
        yield client


@pytest.fixture
def served(llama_dir: Path) -> Iterator[tuple[str, Any, FakeDecodeWorker]]:
    """Over real HTTP (uvicorn), a fake decode worker behind it."""
    fake = FakeDecodeWorker(step_s=0.01)
    config = ClusterConfig.from_dict({"model": str(llama_dir), "prefill": {"replicas": 0},
                                      "router": {"served_model_name": NAMES, "health_interval_s": 0.1,
                                                 "worker_timeout_s": 0.6}})
    router = router_for(config, {"decode-0": fake.address})
    try:
        with serving(router, free_port()) as base:
            yield base, router, fake
    finally:
        fake.close()


def error_of(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    return response.json()["error"]


# --- served model names -------------------------------------------------------------

@pytest.mark.parametrize("value,message", [
    ([], "router.served_model_name: must be a name or a non-empty list of names, got []"),
    (7, "router.served_model_name: must be a name or a non-empty list of names, got 7"),
    ("", "router.served_model_name: must be a non-empty string"),
    (["a", " b"], "router.served_model_name[1]: must be a non-empty string without leading or trailing spaces"),
    (["a", 3], "router.served_model_name[1]: must be a non-empty string"),
    (["a", "a"], "router.served_model_name[1]: 'a' is listed twice"),
])
def test_served_model_name_mistakes_are_named(value: Any, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        ClusterConfig.from_dict({"model": "m", "router": {"served_model_name": value}})
    assert message in str(err.value)


def test_served_model_name_is_one_name_or_aliases() -> None:
    def names(router: dict[str, Any]) -> Any:
        return ClusterConfig.from_dict({"model": "m", "router": router}).router.served_model_name

    assert names({"served_model_name": "x"}) == ("x",) and names({"served_model_name": NAMES}) == tuple(NAMES)
    assert names({}) is None


def test_models_lists_the_served_names_and_another_model_is_a_404(http: TestClient) -> None:
    listed = http.get("/v1/models").json()
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == NAMES
    assert all(m["object"] == "model" and m["owned_by"] == "pdserve" and m["max_model_len"] > 0
               for m in listed["data"])
    assert http.get("/v1/models/alias").json() == listed["data"][1]
    for path in ("/v1/models/gpt-9", "/v1/models/org/gpt-9"):
        error = error_of(http.get(path), 404)
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert error["type"] == "invalid_request_error" and "'tiny-llama', 'alias'" in error["message"]
    for path, body in (("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                       ("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [5]})):
        error = error_of(http.post(path, json={"model": "gpt-9", **body}), 404)
        assert error["code"] == "model_not_found" and error["param"] == "model", path
        assert "model 'gpt-9' is not served here" in error["message"]
    assert error_of(http.post("/tokenize", json={"model": 5, "prompt": "Hi"}), 400)["param"] == "model"


def test_without_a_served_name_the_model_path_is_listed_and_its_directory_accepted(llama_dir: Path) -> None:
    with app_with(llama_dir) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [str(llama_dir)]
        assert client.get(f"/v1/models/{llama_dir.name}").status_code == 200
        assert client.post("/tokenize", json={"model": llama_dir.name, "prompt": "Hi"}).status_code == 200
        assert client.post("/tokenize", json={"model": "tiny-llama", "prompt": "Hi"}).status_code == 404


@pytest.mark.timeout(60)
def test_responses_carry_the_first_served_name_and_priority_reaches_the_worker(served) -> None:
    base, _, fake = served
    status, out = request(base, "POST", "/v1/completions", {"model": "alias", "prompt": "Hi", "max_tokens": 2,
                                                            "priority": -5})
    assert status == 200 and out["model"] == "tiny-llama"
    assert fake.messages("generate")[-1].priority == -5
    status, out = request(base, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "priority": 3})
    assert status == 200 and out["model"] == "tiny-llama" and fake.messages("generate")[-1].priority == 3
    status, _ = request(base, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 200 and fake.messages("generate")[-1].priority == 0


@pytest.mark.parametrize("value", [True, 1.5, "1", 2**63, -2**63 - 1, [1]])
def test_a_bad_priority_is_a_400_naming_it(http: TestClient, value: Any) -> None:
    error = error_of(http.post("/v1/completions", json={"prompt": "Hi", "priority": value}), 400)
    assert error["param"] == "priority" and "priority must be an integer in [-2^63, 2^63)" in error["message"]


# --- routes, methods, HEAD ------------------------------------------------------------

def test_unknown_routes_and_methods_answer_in_the_openai_shape(http: TestClient) -> None:
    for method, path in (("GET", "/v1/nothing"), ("POST", "/v2/completions"), ("GET", "/")):
        error = error_of(http.request(method, path), 404)
        assert error["message"].startswith(f"Invalid URL ({method} {path})")
        assert error["type"] == "invalid_request_error" and error["param"] is None
    response = http.get("/v1/completions")
    error = error_of(response, 405)
    assert "GET /v1/completions" in error["message"] and "takes POST" in error["message"]
    assert response.headers["allow"] == "POST"
    response = http.post("/health")
    assert error_of(response, 405)["type"] == "invalid_request_error"
    assert response.headers["allow"] == "GET, HEAD"  # its HEAD is a route of its own
    # A trailing slash is an unknown route too: never a redirect built from the Host header.
    response = http.post("/v1/completions/", json={"prompt": "hi"}, headers={"host": "evil.example"},
                         follow_redirects=False)
    assert "location" not in response.headers and error_of(response, 404)["param"] is None


@pytest.mark.parametrize("body,message", [
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options is only allowed with stream: true"),
    ({"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats=True is not supported"),
])
def test_stream_options_it_cannot_honour_are_refused(http: TestClient, body: dict, message: str) -> None:
    error = error_of(http.post("/v1/completions", json=body), 400)
    assert message in error["message"] and error["param"] == "stream_options"


def test_without_a_key_an_unknown_route_is_a_401_and_with_one_a_404(llama_dir: Path) -> None:
    with app_with(llama_dir, api_keys=[KEY]) as client:
        for method, path in (("GET", "/v1/nothing"), ("GET", "/v1/completions"), ("POST", "/tokenize"),
                             ("GET", "/version"), ("GET", "/v1/models/x")):
            assert error_of(client.request(method, path), 401)["code"] == "invalid_api_key", path
        auth = {"Authorization": f"Bearer {KEY}"}
        assert error_of(client.get("/v1/nothing", headers=auth), 404)["message"].startswith("Invalid URL")
        assert error_of(client.get("/v1/completions", headers=auth), 405)
        assert client.post("/tokenize", json={"prompt": "Hi"}, headers=auth).status_code == 200
        assert client.head("/health").status_code == 200  # open, as GET /health


@pytest.mark.timeout(60)
def test_head_answers_as_get_without_a_body(served) -> None:
    base, router, fake = served
    for path in ("/health", "/v1/models", "/version"):
        get, head = open_request(base, "GET", path, None, 10), open_request(base, "HEAD", path, None, 10)
        body = get.read()
        assert head.status == get.status == 200 and head.read() == b"", path
        assert head.getheader("content-length") == str(len(body))
    fake.silent.set()  # no live decode worker: HEAD /health says 503, as GET does
    deadline = time.monotonic() + 10
    while open_request(base, "HEAD", "/health", None, 10).status != 503:
        assert time.monotonic() < deadline, "HEAD /health did not turn 503"
        time.sleep(0.1)


# --- /tokenize, /detokenize, /version ---------------------------------------------------

def test_tokenize_a_prompt_and_detokenize_it_back(http: TestClient) -> None:
    tokenizer = http.app.state.router.tokenizer
    text = "Hello world, in blocks"
    out = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    ids = tokenizer.encode(text)
    assert out == {"count": len(ids), "max_model_len": http.app.state.router.max_model_len, "tokens": ids,
                   "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    plain = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode(text, add_special_tokens=False) and plain["token_strs"] is None
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}
    assert tokenizer.decode(ids) == text


def test_tokenize_messages_as_chat_completions_renders_them(http: TestClient) -> None:
    router = http.app.state.router
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    for flags in ({}, {"add_generation_prompt": False}):
        out = http.post("/tokenize", json={"messages": messages, **flags}).json()
        parsed = asyncio.run(router.parser.chat(json.dumps({"messages": messages, **flags}).encode()))
        assert out["tokens"] == parsed.prompt_ids and out["count"] == len(parsed.prompt_ids)
    with_prompt = http.post("/tokenize", json={"messages": messages}).json()["count"]
    without = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()["count"]
    assert with_prompt > without  # the template's assistant opening


@pytest.mark.parametrize("path,body,param,message", [
    ("/tokenize", {"prompt": ""}, "prompt", "prompt must be a non-empty string, got ''"),
    ("/tokenize", {"prompt": [1, 2]}, "prompt", "prompt must be a non-empty string"),
    ("/tokenize", {}, "prompt", "send prompt (text) or messages (a chat) to tokenize"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt", "not both"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens", "must be a boolean"),
    ("/tokenize", {"prompt": "a", "return_token_strs": 1}, "return_token_strs", "must be a boolean"),
    ("/tokenize", {"messages": []}, "messages", "messages must be a non-empty list"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "chat_template": "{{x}}"}, "chat_template",
     "chat_template='{{x}}' is not supported by pdserve"),
    ("/tokenize", {"prompt": "x" * 1_000_000}, "prompt", "more than the model's context length"),
    ("/detokenize", {"tokens": []}, "tokens", "tokens must be a non-empty list of token ids"),
    ("/detokenize", {"tokens": [1, "2"]}, "tokens", "tokens must be a non-empty list of token ids"),
    ("/detokenize", {"tokens": [1, True]}, "tokens", "tokens must be a non-empty list of token ids"),
    ("/detokenize", {"tokens": [5, 100_000, -1]}, "tokens", "tokens must be integers in [0, "),
    ("/detokenize", {"tokens": [5] * 5000}, "tokens", "tokens has 5000 ids; at most the model's context length"),
])
def test_bad_tokenize_input_is_a_400_naming_the_field(http: TestClient, path: str, body: dict, param: str,
                                                      message: str) -> None:
    error = error_of(http.post(path, json=body), 400)
    assert error["param"] == param and message in error["message"], error


def test_tokenize_counts_against_the_keys_request_rate(llama_dir: Path) -> None:
    with app_with(llama_dir, key_requests_per_s=0.01, key_burst=2) as client:
        assert client.post("/tokenize", json={"prompt": "a"}).status_code == 200
        assert client.post("/detokenize", json={"tokens": [5]}).status_code == 200
        response = client.post("/tokenize", json={"prompt": "a"})
        assert error_of(response, 429)["type"] == "rate_limit_error" and int(response.headers["retry-after"]) >= 1
        assert client.get("/version").status_code == 200  # not rate-limited


@pytest.mark.timeout(60)
def test_tokenize_runs_off_the_event_loop(served) -> None:
    base, router, _ = served
    tokenizer = router.tokenizer
    slow_tokenizer(router)
    result: dict[str, Any] = {}
    post = threading.Thread(target=lambda: result.update(out=request(base, "POST", "/tokenize", {"prompt": "Hi"})))
    post.start()
    time.sleep(0.3)  # the request is in the tokenizer now
    start = time.monotonic()
    assert request(base, "GET", "/health")[0] == 200
    assert time.monotonic() - start < 1.0  # not after the 2 s tokenization
    post.join(20)
    assert result["out"] == (200, {"count": len(tokenizer.encode("Hi")), "max_model_len": router.max_model_len,
                                   "tokens": tokenizer.encode("Hi"), "token_strs": None})


def test_version_is_the_packages(http: TestClient) -> None:
    expected = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert http.get("/version").json() == {"version": expected}
