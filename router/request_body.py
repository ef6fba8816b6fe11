"""Reading an OpenAI request body before any token exists: which fields pdserve honours,
which it refuses, and the shape of the prompt or messages.

Every problem is an APIError(400) naming the field (`param`), in the OpenAI error
format. A parameter pdserve does not implement is refused, never silently ignored,
unless its value is the one that means "off" (clients often send defaults
explicitly). Fields nobody here knows are ignored, as vLLM does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, cast

from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.user_values import show
from router.errors import APIError
from router.logprobs import requested_logprobs

# OpenAI / vLLM request fields passed on to SamplingParams as they are.
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                   "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty",
                   "min_tokens", "ignore_eos", "include_stop_str_in_output", "logit_bias", "allowed_token_ids",
                   "bad_words")
# Newer OpenAI name of max_tokens (chat); accepted on both endpoints.
MAX_TOKENS_ALIAS = "max_completion_tokens"
# JSON nesting a request may hold anywhere (router/bounds.py checks the fields pdserve
# reads; a history tool call's arguments here): deeper is no request anyone sends, and
# the code reading it (a schema's checks, the chat template) recurses.
MAX_DEPTH = 64


def _unset(value: Any) -> bool:
    return value is None or value is False or value == "" or value == [] or value == {}


def _one(value: Any) -> bool:
    return value is None or (type(value) is int and value == 1)


def _default_true(value: Any) -> bool:
    return value is None or value is True


# Parameter -> is this value harmless (means "not used")? Any other value: 400.
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "use_beam_search": _unset,
    "guided_json": _unset, "guided_regex": _unset, "guided_choice": _unset,
    "guided_grammar": _unset, "guided_decoding_backend": _unset,
    "logits_processors": _unset, "truncate_prompt_tokens": _unset,
    "skip_special_tokens": _default_true, "spaces_between_special_tokens": _default_true,
    "return_tokens_as_token_ids": _unset, "return_token_ids": _unset, "cache_salt": _unset,
}
_UNSUPPORTED_COMPLETIONS: dict[str, Callable[[Any], bool]] = {"suffix": _unset, "prompt_embeds": _unset}
_UNSUPPORTED_CHAT: dict[str, Callable[[Any], bool]] = {
    "best_of": _one, "functions": _unset, "function_call": lambda v: v in (None, "none", "auto"),
    "echo": _unset, "prompt_logprobs": _unset, "continue_final_message": _unset, "chat_template": _unset,
    "chat_template_kwargs": _unset, "documents": _unset, "audio": _unset, "prediction": _unset,
    "modalities": lambda v: v is None or v == ["text"],
}


_GUIDED = "vLLM 0.12 removed the guided_* fields: send structured_outputs"
_HINTS = {"best_of": "best_of is a completions parameter; chat samples n choices",
          "echo": "only on /v1/completions", "prompt_logprobs": "only on /v1/completions",
          "guided_json": _GUIDED, "guided_regex": _GUIDED, "guided_choice": _GUIDED, "guided_grammar": _GUIDED,
          "guided_decoding_backend": "pdserve's one backend is xgrammar",
          "functions": "the legacy functions field: send tools", "function_call": "send tool_choice",
          "cache_salt": "the prefix cache is shared by every request of a deployment; isolate tenants by deployment",
          "prompt_embeds": "send the prompt as text or token ids"}


def read_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise APIError(400, "request body is not valid JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of > 4300 digits
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body


def check_unsupported(body: dict[str, Any], chat: bool) -> None:
    table = _UNSUPPORTED | (_UNSUPPORTED_CHAT if chat else _UNSUPPORTED_COMPLETIONS)
    for name, harmless in table.items():
        if name in body and not harmless(body[name]):
            hint = f" ({_HINTS[name]})" if name in _HINTS else ""
            raise APIError(400, f"{name}={show(body[name])} is not supported by pdserve{hint}", name)


def include_usage(body: dict[str, Any], stream: bool) -> bool:
    """stream_options.include_usage (streamed responses only, as OpenAI and vLLM say)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise APIError(400, "stream_options is only allowed with stream: true", "stream_options")
    if not isinstance(options, dict):
        raise APIError(400, f"stream_options must be an object, got {show(options)}", "stream_options")
    if options.get("continuous_usage_stats"):
        raise APIError(400, f"stream_options.continuous_usage_stats={show(options['continuous_usage_stats'])} is "
                            "not supported by pdserve (include_usage sends the usage once, at the end)",
                       "stream_options")
    usage = options.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise APIError(400, f"stream_options.include_usage must be a boolean, got {show(usage)}",
                       "stream_options")
    return bool(usage)


def flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"{name} must be a boolean, got {show(value)}", name)
    return value


def priority(body: dict[str, Any]) -> int:
    """vLLM's `priority`: lower is scheduled first, ties by arrival (default 0). Any
    64-bit integer, as the worker protocol carries it."""
    value = body.get("priority")
    if value is None:
        return 0
    if type(value) is not int or not -2**63 <= value < 2**63:
        raise APIError(400, f"priority must be an integer in [-2^63, 2^63), got {show(value)}", "priority")
    return value


def sampling_options(body: dict[str, Any], chat: bool,
                     default_max_tokens: int | None) -> tuple[dict[str, Any], dict[str, str]]:
    """The SamplingParams fields the body sets, as sent (max_tokens defaulting to
    default_max_tokens; None: SamplingParams' own default), and the name the client used
    for each field it sent under another (for errors). The parser adds the fields it
    decides itself, then builds the params once (sampling_params)."""
    options = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    alias = body.get(MAX_TOKENS_ALIAS)
    names = {}  # SamplingParams field -> the name the client used, for errors
    if alias is not None:
        if "max_tokens" in options and options["max_tokens"] != alias:
            raise APIError(400, f"max_tokens ({show(options['max_tokens'])}) and {MAX_TOKENS_ALIAS} "
                                f"({show(alias)}) differ; send one of them", MAX_TOKENS_ALIAS)
        options["max_tokens"] = alias
        names["max_tokens"] = MAX_TOKENS_ALIAS
    if "max_tokens" not in options and default_max_tokens is not None:
        options["max_tokens"] = default_max_tokens
    options["logprobs"] = requested_logprobs(body, chat)
    return options, names


def sampling_params(options: dict[str, Any], names: dict[str, str]) -> SamplingParams:
    """The request's SamplingParams, built (and so validated) once: a bad field is a 400
    under the name the client used."""
    try:
        return SamplingParams(**options)
    except SamplingParamsError as exc:
        name = names.get(exc.param, exc.param)
        raise APIError(400, f"{name} {exc.problem}", name) from None


def check_vocab(params: SamplingParams, vocab_size: int) -> None:
    """The token controls' ids (bad_words: as tokenized) are in the model's vocabulary."""
    outside = params.out_of_vocab(vocab_size)
    if outside is not None:
        name, ids = outside
        raise APIError(400, f"{name} token ids must be in [0, {vocab_size}), got {show(ids)}", name)


def prompt_input(prompt: Any, vocab_size: int) -> list[str] | list[list[int]]:
    """/v1/completions' prompt as a batch: a non-empty string, or token ids of this
    model's vocabulary, or a non-empty list of either (batched prompts, all of one kind)."""
    if isinstance(prompt, str) or _token_ids(prompt):
        return cast("list[str] | list[list[int]]", [_one_prompt(prompt, "prompt", vocab_size)])
    if isinstance(prompt, list) and not prompt:
        raise APIError(400, "prompt must not be an empty list", "prompt")
    if isinstance(prompt, list) and (all(isinstance(p, str) for p in prompt) or all(map(_token_ids, prompt))):
        # All of one kind: checked just above.
        return cast("list[str] | list[list[int]]", [_one_prompt(p, f"prompt[{i}]", vocab_size)
                                                    for i, p in enumerate(prompt)])
    raise APIError(400, "prompt must be a non-empty string or a list of token ids, or a list of several of either "
                        "(batched prompts: all strings or all token-id lists)", "prompt")


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def _one_prompt(prompt: str | list[int], where: str, vocab_size: int) -> str | list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, f"{where} must not be empty", "prompt")
        check_text(prompt, "prompt", where)
        return prompt
    if not prompt:
        raise APIError(400, f"{where} must not be an empty list of token ids", "prompt")
    bad = outside_vocab(prompt, vocab_size)
    if bad:
        raise APIError(400, f"{where} token ids must be integers in [0, {vocab_size}), got {show(bad)}", "prompt")
    return prompt


def outside_vocab(ids: list[int], vocab_size: int) -> list[int]:
    """The first few (5, enough for a message) of `ids` outside [0, vocab_size)."""
    return [t for t in ids if not 0 <= t < vocab_size][:5]


def check_tokenized(ids: list[int], vocab_size: int, where: str, param: str) -> None:
    """Text the tokenizer turned into ids the model has no embedding for (a tokenizer
    with added tokens past the model's vocab_size): that request's 400, as a token-id
    prompt's (vLLM refuses it too)."""
    bad = outside_vocab(ids, vocab_size)
    if bad:
        raise APIError(400, f"{where} tokenizes to ids outside the model's vocabulary [0, {vocab_size}): "
                            f"{show(bad)} (the tokenizer has tokens the model does not)", param)


def choices(body: dict[str, Any], chat: bool, stream: bool, max_n: int) -> tuple[int, int]:
    """(n, best_of): the choices answered per prompt, and the sequences sampled per
    prompt to pick them from (best_of >= n; completions only, chat samples n)."""
    n = _count(body, "n", max_n)
    best_of = n if chat else _count(body, "best_of", max_n, default=n)
    if best_of < n:
        raise APIError(400, f"best_of ({best_of}) must be >= n ({n}): it is how many sequences the n choices "
                            "are picked from", "best_of")
    if best_of > n and stream:
        raise APIError(400, f"best_of ({best_of}) > n ({n}) cannot be streamed: the choices are known only once "
                            "every sequence has ended", "best_of")
    return n, best_of


def _count(body: dict[str, Any], name: str, max_n: int, default: int = 1) -> int:
    value = body.get(name)
    if value is None:
        return default
    if type(value) is not int or not 1 <= value <= max_n:
        raise APIError(400, f"{name} must be an integer in [1, {max_n}] (router.max_n), got {show(value)}", name)
    return value


def chat_messages(messages: Any, tool_names: set[str] | None = None) -> list[dict[str, Any]]:
    """The messages as the chat template wants them: {role, content} with content a
    string. OpenAI content parts of type "text" are joined with newlines (as vLLM
    does); an assistant message's content may be null (it then is ""). An assistant's
    tool_calls keep their id and function, with the arguments parsed (templates render
    them as objects); a tool message keeps its tool_call_id. `tool_names`: the request's
    tools, which the calls in its history must name (None: no tools defined)."""
    if not (isinstance(messages, list) and messages):
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    return [_message(i, m, tool_names) for i, m in enumerate(messages)]


def _message(i: int, message: Any, tool_names: set[str] | None) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not (isinstance(message, dict) and isinstance(message.get("role"), str)):
        raise APIError(400, f"{where} must be a {{role, content}} object with a string role; messages must "
                            "be a non-empty list of {role, content} objects", "messages")
    role, content = message["role"], message.get("content")
    extra: dict[str, Any] = {}
    if message.get("tool_calls"):
        if role != "assistant":
            raise APIError(400, f"{where}.tool_calls: only assistant messages have tool calls", "messages")
        extra["tool_calls"] = [_tool_call(f"{where}.tool_calls[{j}]", c, tool_names)
                               for j, c in enumerate(_list(message["tool_calls"], f"{where}.tool_calls"))]
    if role == "tool" and message.get("tool_call_id") is not None:
        if not isinstance(message["tool_call_id"], str):
            raise APIError(400, f"{where}.tool_call_id must be a string, got {show(message['tool_call_id'])}",
                           "messages")
        extra["tool_call_id"] = message["tool_call_id"]
    if content is None and role == "assistant":
        content = ""
    elif isinstance(content, list):
        content = "\n".join(_text_part(f"{where}.content[{j}]", p) for j, p in enumerate(content))
    elif not isinstance(content, str):
        raise APIError(400, f"{where}.content must be a string or a list of text parts, got "
                            f"{show(content)}", "messages")
    check_text(role, "messages", f"{where}.role")
    check_text(content, "messages", where)
    return {"role": role, "content": content, **extra}


def _list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise APIError(400, f"{where} must be a list, got {show(value)}", "messages")
    return value


def _nested_deeper(value: Any, limit: int) -> bool:
    """Whether JSON `value` nests objects and arrays more than `limit` levels deep."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        items = value.values() if isinstance(value, dict) else value
        stack.extend((item, depth + 1) for item in items if isinstance(item, (dict, list)))
    return False


def _tool_call(where: str, call: Any, tool_names: set[str] | None) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(function, dict) and call.get("type", "function") == "function"
            and isinstance(function.get("name"), str)
            and isinstance(function.get("arguments"), str)):
        raise APIError(400, f'{where} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}} '
                            f"with string name and arguments, got {show(call)}", "messages")
    name = function["name"]
    if tool_names is not None and name not in tool_names:
        raise APIError(400, f"{where}.function.name {name!r} is not among the tools "
                            f"({', '.join(sorted(tool_names))})", "messages")
    try:
        arguments = json.loads(function["arguments"])
    except RecursionError:
        arguments = None
    except ValueError as exc:
        raise APIError(400, f"{where}.function.arguments is not valid JSON: {exc}", "messages") from None
    if arguments is None or _nested_deeper(arguments, MAX_DEPTH):  # the chat template recurses through it
        raise APIError(400, f"{where}.function.arguments is nested more than {MAX_DEPTH} levels deep", "messages")
    check_text(function["arguments"], "messages", f"{where}.function.arguments")
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise APIError(400, f"{where}.id must be a string, got {show(call_id)}", "messages")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _text_part(where: str, part: Any) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind != "text":
        what = f"of type {show(kind)}" if isinstance(part, dict) else show(part)
        raise APIError(400, f"{where}: content parts {what} are not supported by pdserve (only "
                            "{\"type\": \"text\", \"text\": ...})", "messages")
    if not isinstance(part.get("text"), str):
        raise APIError(400, f"{where}.text must be a string, got {show(part.get('text'))}", "messages")
    return part["text"]


def check_text(text: str, param: str, where: str | None = None) -> None:
    """JSON may carry lone UTF-16 surrogates ("\\ud800"), which no tokenizer or
    msgpack can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"{where or param} is not valid Unicode (it has a lone surrogate)", param) from None

