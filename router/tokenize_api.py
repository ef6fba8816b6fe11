"""POST /tokenize and POST /detokenize, in vLLM's shape, with the served model's tokenizer.

/tokenize takes a `prompt` (text; `add_special_tokens`, default true) or chat
`messages` (rendered by the chat template, as /v1/chat/completions renders them;
`add_generation_prompt`, default true, `add_special_tokens`, default false, and `tools`)
and answers {count, max_model_len, tokens, token_strs}: `token_strs` are the tokens'
vocabulary spellings when `return_token_strs` is true, else null. /detokenize takes
`tokens` and answers {prompt}: their text.

Both pass the generation endpoints' gates (router/http_guard.py: key, rate, body size)
and checks (router/parsing.py: bounds, model, text length), and run the tokenizer in
its one thread, its queue bounded: never on the event loop. Bad input is a 400 naming
the field.
"""

from __future__ import annotations

from typing import Any

from engine.user_values import show
from router import request_body, structured
from router.errors import APIError
from router.parsing import RequestParser, chat_chars, chat_text

# vLLM fields pdserve does not implement here: refused unless "off" (as for generation).
_REFUSED = ("chat_template", "chat_template_kwargs", "continue_final_message", "mm_processor_kwargs")


async def tokenize(parser: RequestParser, raw: bytes) -> dict[str, Any]:
    body = parser.checked_json(raw)
    for name in _REFUSED:
        if body.get(name) not in (None, False, "", {}):
            raise APIError(400, f"{name}={show(body[name])} is not supported by pdserve", name)
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise APIError(400, "send either prompt (text) or messages (a chat), not both" if has_prompt
                       else "send prompt (text) or messages (a chat) to tokenize", "prompt")
    tokenizer = parser.tokenizer
    if has_prompt:
        prompt = body["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise APIError(400, f"prompt must be a non-empty string, got {show(prompt)}", "prompt")
        request_body.check_text(prompt, "prompt")
        parser.check_chars(len(prompt), "prompt")

        def render() -> str:
            return prompt
    else:
        tools = structured.tool_choice(body)
        messages = request_body.chat_messages(body["messages"], set(tools.parameters) if tools else None)
        parser.check_chars(chat_chars(messages, tools), "messages")
        generation_prompt = request_body.flag(body, "add_generation_prompt", True)
        definitions = tools.definitions if tools is not None else None

        def render() -> str:
            return chat_text(tokenizer, messages, definitions, generation_prompt)
    # A chat template writes its special tokens itself (as /v1/chat/completions encodes it).
    special = request_body.flag(body, "add_special_tokens", has_prompt)
    strs = request_body.flag(body, "return_token_strs", False)

    def run() -> tuple[list[int], list[str] | None]:
        ids = tokenizer.encode(render(), add_special_tokens=special)
        return ids, tokenizer.convert_ids_to_tokens(ids) if strs else None

    try:
        ids, token_strs = await parser.in_tokenizer_thread(run)
    except RecursionError:  # the template walks what the bounds let through; never a 500
        raise APIError(400, "messages are nested too deeply for the model's chat template", "messages") from None
    return {"count": len(ids), "max_model_len": parser.limits.max_model_len, "tokens": ids,
            "token_strs": token_strs}


async def detokenize(parser: RequestParser, raw: bytes) -> dict[str, Any]:
    body = parser.checked_json(raw)
    tokens = body.get("tokens")
    vocab_size, max_model_len = parser.limits.vocab_size, parser.limits.max_model_len
    if not (isinstance(tokens, list) and tokens and all(type(t) is int for t in tokens)):
        raise APIError(400, f"tokens must be a non-empty list of token ids, got {show(tokens)}", "tokens")
    if len(tokens) > max_model_len:  # bounds the tokenizer thread's time, as the context bounds a prompt's
        raise APIError(400, f"tokens has {len(tokens)} ids; at most the model's context length "
                            f"({max_model_len}) are accepted", "tokens")
    bad = request_body.outside_vocab(tokens, vocab_size)
    if bad:
        raise APIError(400, f"tokens must be integers in [0, {vocab_size}), got {show(bad)}", "tokens")
    return {"prompt": await parser.in_tokenizer_thread(parser.tokenizer.decode, tokens)}
