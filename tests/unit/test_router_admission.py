"""Admission and input errors at the router, answered before any worker is involved:
each a 400 in the OpenAI error format whose `param` names the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from cluster.config import ClusterConfig
from cluster.serve import router_for
from router.app import create_app


@pytest.fixture
def http(llama_dir: Path):
    config = ClusterConfig.from_dict({"model": str(llama_dir), "router": {"max_queued_requests": 2},
                                      "prefill": {"replicas": 0}})
    # A worker address nobody listens on: these requests never reach a worker.
    router = router_for(config, {"decode-0": "tcp://127.0.0.1:9"})
    with TestClient(create_app(router)) as client:
        yield client, router


def test_a_full_router_answers_429_with_retry_after(http) -> None:
    client, router = http
    router.in_flight = 2  # as if two requests were being served
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert "max_queued_requests" in r.json()["error"]["message"]


@pytest.mark.parametrize("body,message", [
    (b"{not json", "request body is not valid JSON"),
    (b"[1, 2]", "request body must be a JSON object"),
    (b'{"prompt": ""}', "prompt must not be empty"),
    (b'{"prompt": 5}', "prompt must be a non-empty string or a list of token ids"),
    # Parallel sampling and batched prompts: n and best_of within router.max_n (16).
    (b'{"prompt": "hi", "n": 17}', "n must be an integer in [1, 16] (router.max_n), got 17"),
    (b'{"prompt": "hi", "n": 0}', "n must be an integer in [1, 16]"),
    (b'{"prompt": "hi", "n": true}', "n must be an integer in [1, 16] (router.max_n), got True"),
    (b'{"prompt": "hi", "best_of": 17}', "best_of must be an integer in [1, 16]"),
    (b'{"prompt": "hi", "n": 3, "best_of": 2}', "best_of (2) must be >= n (3)"),
    (b'{"prompt": "hi", "n": 2, "best_of": 3, "stream": true}', "best_of (3) > n (2) cannot be streamed"),
    (b'{"prompt": []}', "prompt must not be an empty list"),
    (b'{"prompt": ["a", ""]}', "prompt[1] must not be empty"),
    (b'{"prompt": ["a", [1, 2]]}', "prompt must be a non-empty string or a list of token ids, or a list of several"),
    (b'{"prompt": [[1, 2], [400]]}', "prompt[1] token ids must be integers in [0, 384), got [400]"),
    (b'{"prompt": ["a", "\\ud800"]}', "prompt[1] is not valid Unicode"),
    (b'{"prompt": ' + json.dumps(["a"] * 17).encode() + b', "best_of": 16}',
     "17 prompts x 16 sequences each = 272 sequences: more than a request may sample (router.max_sequences = 256)"),
    (b'{"prompt": "hi", "top_p": 0}', "top_p must be in (0, 1]"),
    # Were HTTP 500 (plain text): values nothing downstream can encode.
    (b"[" * 100000 + b"]" * 100000, "request body is not valid JSON: nested too deeply"),
    (b'{"prompt": "hi", "user": ' + b"1" * 5000 + b"}", "request body is not valid JSON: Exceeds the limit"),
    (b'{"prompt": "hi", "seed": 1180591620717411303424}', "seed must be an integer in ["),
    (b'{"prompt": [1, 1180591620717411303424]}', "prompt token ids must be integers in [0, 384)"),
    (b'{"prompt": "hi", "model": []}', "model must be a string, got []"),
    (b'{"prompt": "hi", "model": {"a": 1}}', "model must be a string"),
    (b'{"prompt": "hi", "stream": true, "stream_options": "x"}', "stream_options must be an object, got 'x'"),
    (b'{"prompt": "hi", "stream": true, "stream_options": [1]}', "stream_options must be an object"),
    (b'{"prompt": "\\ud800 hi"}', "prompt is not valid Unicode (it has a lone surrogate)"),
    (b'{"prompt": "hi", "stop": "\\ud800"}', "stop must be a list of non-empty strings of valid Unicode"),
    (b'{"prompt": "hi", "stop_token_ids": [1180591620717411303424]}', "stop_token_ids must be integers in [0, "),
    # Were Python internals with param null: the field and the type it must have.
    (b'{"prompt": "hi", "max_tokens": "10"}', "max_tokens must be an integer, got '10'"),
    (b'{"prompt": "hi", "max_tokens": true}', "max_tokens must be an integer, got True"),
    (b'{"prompt": "hi", "temperature": "hot"}', "temperature must be a number, got 'hot'"),
    (b'{"prompt": "hi", "top_p": "a"}', "top_p must be a number, got 'a'"),
    (b'{"prompt": "hi", "presence_penalty": "a"}', "presence_penalty must be a number"),
    (b'{"prompt": "hi", "temperature": 1e309}', "temperature must be a finite number, got inf"),
    (b'{"prompt": "hi", "stop": 5}', "stop must be a string or a list of strings, got 5"),
    (b'{"prompt": "hi", "stop": {}}', "stop must be a string or a list of strings, got {}"),
    (b'{"prompt": "hi", "ignore_eos": "yes"}', "ignore_eos must be a boolean, got 'yes'"),
    (b'{"prompt": "hi", "stream": "yes"}', "stream must be a boolean, got 'yes'"),
    (b'{"prompt": "hi", "min_tokens": 50, "max_tokens": 3}', "min_tokens must be in [0, max_tokens=3], got 50"),
    (b'{"prompt": "hi", "repetition_penalty": 1e-38}', "repetition_penalty must be in [0.01, 100]"),
    (b'{"prompt": "hi", "repetition_penalty": 1000}', "repetition_penalty must be in [0.01, 100]"),
    (b'{"prompt": "hi", "max_tokens": 2000}', "exceeds the model's context length 1024"),
    (b'{"prompt": ' + str([1] * 1029).encode() + b'}', "prompt has 1029 tokens, but the model's"),
    # Not implemented: refused by name rather than silently ignored.
    (b'{"prompt": "hi", "logit_bias": {"384": -100}}', "logit_bias token ids must be in [0, 384), got [384]"),
    (b'{"prompt": "hi", "stop_token_ids": [2, 1000000]}', "stop_token_ids token ids must be in [0, 384), got [1000000]"),
    (b'{"prompt": "hi", "use_beam_search": true}', "use_beam_search=True is not supported by pdserve"),
    (b'{"prompt": "hi", "echo": "yes"}', "echo must be a boolean, got 'yes'"),
    (b'{"prompt": "hi", "max_tokens": 0}', "max_tokens=0 needs echo: true"),
    (b'{"prompt": "hi", "echo": true, "prompt_logprobs": 21}', "prompt_logprobs must be an integer in [0, 20]"),
    (b'{"prompt": "hi", "echo": true, "logprobs": 1, "n": 2}', "n (or best_of) > 1 (2 sequences) with prompt logprobs"),
    (b'{"prompt": "hi", "suffix": "xyz"}', "suffix='xyz' is not supported"),
    (b'{"prompt": "hi", "skip_special_tokens": false}', "skip_special_tokens=False is not supported"),
    (b'{"prompt": "hi", "return_tokens_as_token_ids": true}', "return_tokens_as_token_ids=True is not supported"),
    (b'{"prompt": "hi", "return_token_ids": true}', "return_token_ids=True is not supported"),
    (b'{"prompt": "hi", "cache_salt": "tenant-a"}', "cache_salt='tenant-a' is not supported"),
    (b'{"prompt": "hi", "prompt_embeds": "AAAA"}', "prompt_embeds='AAAA' is not supported"),
    (b'{"prompt": "hi", "response_format": {"type": "json_object", "x": 1}, "structured_outputs": {"regex": "a"}}',
     "response_format and structured_outputs both constrain the output; send one of them"),
    (b'{"prompt": "hi", "structured_outputs": {"choice": []}}',
     "structured_outputs.choice must be a non-empty list of non-empty strings"),
    (b'{"prompt": "hi", "structured_outputs": {"pattern": "a"}}', "structured_outputs.pattern is not supported"),
    (b'{"prompt": "hi", "structured_outputs": {}}', "structured_outputs must set exactly one of"),
])
def test_malformed_requests_get_400_naming_the_problem(http, body: bytes, message: str) -> None:
    client, _ = http
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] is None
    field = message.split()[0].split("=")[0]
    expected = {"request": None, "exceeds": "max_tokens", "17": "prompt"}.get(field, field.split(".")[0].split("[")[0])
    assert error["param"] == expected


USER = {"role": "user", "content": "Hi"}


@pytest.mark.parametrize("body,param,message", [
    ({"messages": [{"role": "user"}]}, "messages", "messages[0].content must be a string or a list of text parts"),
    ({"messages": []}, "messages", "messages must be a non-empty list"),
    ({"messages": [{"content": "Hi"}]}, "messages", "messages[0] must be a {role, content} object"),
    ({"messages": [{"role": "user", "content": None}]}, "messages", "messages[0].content must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages",
     "messages[0].content[0]: content parts of type 'image_url' are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages",
     "messages[0].content[0].text must be a string"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages", "messages[0] is not valid Unicode"),
    ({"messages": [{"role": "\ud800", "content": "Hi"}]}, "messages", "messages[0].role is not valid Unicode"),
    ({"messages": [USER], "max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens",
     "max_tokens (4) and max_completion_tokens (5) differ"),
    ({"messages": [USER], "max_completion_tokens": -1}, "max_completion_tokens",
     "max_completion_tokens must be an integer >= 1, got -1"),
    ({"messages": [USER], "max_completion_tokens": 5000}, "max_completion_tokens",
     "+ max_completion_tokens (5000) ="),
    ({"messages": [USER], "tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools",
     "tools[0].function.name must be 1-64 letters, digits, _ or -, got 'f g'"),
    ({"messages": [USER], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice",
     "tool_choice names function 'g', which is not among the tools (f)"),
    ({"messages": [USER], "tool_choice": "required"}, "tool_choice",
     "tool_choice='required' needs tools: none are defined"),
    ({"messages": [USER], "response_format": {"type": "json_schema"}}, "response_format",
     "response_format.json_schema must be an object with name and schema"),
    ({"messages": [USER], "response_format": {"type": "xml"}}, "response_format",
     'response_format must be {"type": "text"}'),
    ({"messages": [USER], "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "must set exactly one of json, regex, choice, grammar, json_object, structural_tag; got regex, choice"),
    ({"messages": [USER], "structured_outputs": {"json": {}}, "response_format": {"type": "json_object"}},
     "response_format", "response_format and structured_outputs both constrain the output"),
    ({"messages": [USER], "guided_json": {"type": "object"}}, "guided_json",
     "vLLM 0.12 removed the guided_* fields: send structured_outputs"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{"}}]}, USER],
      "tools": [{"type": "function", "function": {"name": "f"}}]}, "messages",
     "messages[0].tool_calls[0].function.arguments is not valid JSON"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "code", "function": {"name": "f", "arguments": "{}"}}]}, USER]}, "messages",
     'messages[0].tool_calls[0] must be {"id", "type": "function"'),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "h", "arguments": "{}"}}]}, USER],
      "tools": [{"type": "function", "function": {"name": "f"}}]}, "messages",
     "messages[0].tool_calls[0].function.name 'h' is not among the tools (f)"),
    # Tool definitions and calls count towards the characters a template may render.
    ({"messages": [USER], "tools": [{"type": "function", "function": {"name": "f", "description": "x" * 50_000}}]},
     "messages", "characters: more than the model's context length"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"a": "x" * 10**6})}}]},
        USER]}, "messages", "characters: more than the model's context length"),
    ({"messages": [USER], "logprobs": 2}, "logprobs", "logprobs must be a boolean"),
    ({"messages": [USER], "n": 17}, "n", "n must be an integer in [1, 16] (router.max_n), got 17"),
    ({"messages": [USER], "n": 2, "best_of": 3}, "best_of", "best_of=3 is not supported by pdserve (best_of is a "
     "completions parameter; chat samples n choices)"),
    ({"messages": [USER], "add_generation_prompt": "no"}, "add_generation_prompt",
     "add_generation_prompt must be a boolean"),
])
def test_chat_requests_are_checked(http, body: dict, param: str, message: str) -> None:
    client, _ = http
    # json.dumps escapes the lone surrogate ("\\ud800"), as a client's JSON would
    r = client.post("/v1/chat/completions", content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == param


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(http) -> None:
    client, router = http
    tokenizer = router.tokenizer

    class CountingTokenizer:
        calls = 0

        def __getattr__(self, name: str) -> object:
            return getattr(tokenizer, name)

        def encode(self, *args: object, **kwargs: object) -> list[int]:
            CountingTokenizer.calls += 1
            return tokenizer.encode(*args, **kwargs)

    router.tokenizer = CountingTokenizer()
    limit = router.max_model_len * router.parser.max_token_chars
    r = client.post("/v1/completions", json={"prompt": "x" * (limit + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert f"prompt has {limit + 1} characters: more than the model's context length" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * (limit + 1)}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert CountingTokenizer.calls == 0
    # Within the cap, the tokenizer decides: still too long, but said with its token count.
    r = client.post("/v1/completions", json={"prompt": "hello " * (router.max_model_len + 10)})
    assert r.status_code == 400 and "tokens, but the model's context length is 1024" in r.json()["error"]["message"]
    assert CountingTokenizer.calls == 1


def test_health_is_503_while_no_decode_worker_is_live(http) -> None:
    client, router = http
    assert client.get("/health").status_code == 200
    router.pool.decode["decode-0"].health.alive = False  # as if it had been silent past worker_timeout_s
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    assert "no decode worker is alive" in r.json()["error"]["message"]


def test_no_live_decode_worker_answers_503(http) -> None:
    client, router = http
    router.pool.decode["decode-0"].health.alive = False  # as if it had been silent past worker_timeout_s
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 503 and "no decode worker is alive" in r.json()["error"]["message"]


def test_silent_names_the_workers_declared_dead_for_their_silence_alone(http) -> None:
    """What the local supervisor asks once a pass (it kills those processes)."""
    _, router = http
    assert router.control.silent() == set()
    worker = router.pool.decode["decode-0"]
    assert worker.health.expired(worker.health.last_heard + worker.health.timeout_s + 1)
    assert router.control.silent() == {worker.name}
    worker.health.kill()  # a supervisor's own word (it saw the process exit): not hung
    assert router.control.silent() == set()


def test_a_custom_role_reaches_the_chat_template(http) -> None:
    """vLLM takes roles beyond OpenAI's (its CustomChatCompletionMessageParam): the
    template renders them, or refuses them itself (next test)."""
    client, _ = http
    r = client.post("/tokenize", json={"messages": [{"role": "narrator", "content": "Once"}, USER]})
    assert r.status_code == 200, r.text
    assert "narrator: Once" in client.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]


def test_a_chat_templates_refusal_is_a_400_naming_messages(http, monkeypatch: pytest.MonkeyPatch) -> None:
    import jinja2

    client, router = http

    def refuse(*args, **kwargs):  # as a template's raise_exception("...") does
        raise jinja2.TemplateError("Conversation roles must alternate user/assistant/user/assistant/...")

    monkeypatch.setattr(router.tokenizer, "apply_chat_template", refuse)
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "narrator", "content": "Once"}, USER]})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "messages" and error["message"] == (
        "the model's chat template refused these messages: Conversation roles must alternate "
        "user/assistant/user/assistant/..."), r.text


@pytest.mark.parametrize("path,stream", [("/v1/chat/completions", False), ("/v1/chat/completions", True),
                                         ("/tokenize", False)])
def test_chat_on_a_model_without_a_chat_template_is_a_400(http, monkeypatch: pytest.MonkeyPatch, path: str,
                                                          stream: bool) -> None:
    """A base model's tokenizer (Gemma 3 270M's) has none: transformers raises a
    ValueError, which was a 500."""
    client, router = http
    monkeypatch.setattr(router.tokenizer, "chat_template", None)
    body = {"messages": [USER], **({"stream": True} if stream else {})}
    r = client.post(path, json=body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "messages", r.text
    assert "no chat template: send the prompt to /v1/completions" in error["message"]
    assert client.post("/tokenize", json={"prompt": "Hi"}).status_code == 200  # and the router goes on


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_a_body_sent_as_other_than_json_is_refused_as_vllm_does(http, path: str) -> None:
    client, _ = http
    body = json.dumps({"prompt": "Hi", "messages": [USER], "tokens": [5]})
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r = client.post(path, content=body, headers={"content-type": kind})
        assert r.status_code == 400 and r.json()["error"]["message"] == (
            f"Unsupported Media Type {kind!r}: only 'application/json' is allowed (send Content-Type: "
            "application/json)"), (kind, r.text)
    if path == "/detokenize":  # these two reach no worker
        for kind in ("application/json", "Application/JSON; charset=utf-8"):
            assert client.post(path, content=body, headers={"content-type": kind}).status_code == 200, kind
        assert client.post(path, content=body).status_code == 200  # none at all passes
