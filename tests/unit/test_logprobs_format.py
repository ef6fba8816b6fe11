"""Logprobs as the client reads them (router/logprobs.py): token texts and bytes of
characters split over several byte-level tokens, and chat's `logprobs` switch, as vLLM
answers them."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.errors import APIError
from router.logprobs import LogprobFormatter, requested_logprobs

TEXT = "Hi 日本 ok 🙂."


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path):
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(str(llama_dir))


def entries(ids: list[int]) -> list[list]:
    return [[-0.5, [[t, -0.5]]] for t in ids]


def test_a_character_split_over_tokens_is_said_by_the_token_that_completes_it(tokenizer) -> None:
    """The tiny tokenizer spells each CJK character and the emoji as one token per
    byte: alone, each decodes to U+FFFD. As vLLM does, the tokens before the last say
    "" (no bytes) and the last says the whole character, so the bytes join to the text."""
    ids = tokenizer.encode(TEXT)
    assert any(tokenizer.decode([t]) == "\ufffd" for t in ids)  # the case this is about
    content = LogprobFormatter(tokenizer, chat=True).format(ids, entries(ids))["content"]
    assert all("\ufffd" not in e["token"] and e["bytes"] == list(e["token"].encode()) for e in content)
    assert b"".join(bytes(e["bytes"]) for e in content).decode() == TEXT
    assert "".join(e["token"] for e in content) == TEXT
    # A top alternative is read after the same tokens as the sampled one it stands beside.
    assert all(e["top_logprobs"][0]["token"] == e["token"] for e in content)


def test_completions_tokens_and_offsets_add_up_to_the_text(tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    out = LogprobFormatter(tokenizer, chat=False).format(ids, entries(ids))
    assert "".join(out["tokens"]) == TEXT
    assert out["text_offset"] == [sum(map(len, out["tokens"][:i])) for i in range(len(ids))]


def test_completions_top_logprobs_hold_the_chosen_token_first(tokenizer) -> None:
    """OpenAI's legacy completions "always return the logprob of the sampled token" among
    the top ones (up to logprobs + 1 entries), and vLLM does: also where it is not among
    the k most likely, and with logprobs 0 (nothing else)."""
    hi, there, other = tokenizer.encode("Hi there ok")[:3]
    out = LogprobFormatter(tokenizer, chat=False).format(
        [hi, there, other], [[-2.0, [[there, -0.1]]], [-0.1, [[there, -0.1]]], [-3.0, []]])
    texts = out["tokens"]
    assert out["top_logprobs"] == [{texts[0]: -2.0, tokenizer.decode([there]): -0.1}, {texts[1]: -0.1},
                                   {texts[2]: -3.0}]
    assert [list(top)[0] for top in out["top_logprobs"]] == texts


def test_a_sequence_split_over_chunks_keeps_its_context(tokenizer) -> None:
    """A stream formats a sequence chunk by chunk: a character split across two chunks
    is said whole by the second."""
    ids = tokenizer.encode("\u65e5")
    formatter = LogprobFormatter(tokenizer, chat=True)
    first = formatter.format(ids[:1], entries(ids[:1]))["content"]
    rest = formatter.format(ids[1:], entries(ids[1:]))["content"]
    assert [e["token"] for e in first + rest] == [""] * (len(ids) - 1) + ["\u65e5"]


@pytest.mark.parametrize("switch,top,expected", [
    (0, None, None), (False, None, None), (None, None, None), (1, None, 0), (True, 3, 3), (1, 2, 2)])
def test_chat_logprobs_takes_0_and_1_as_false_and_true(switch, top, expected) -> None:
    body = {"logprobs": switch} if top is None else {"logprobs": switch, "top_logprobs": top}
    assert requested_logprobs(body, chat=True) == expected


@pytest.mark.parametrize("switch", [2, -1, 0.0, "true", "0"])
def test_chat_logprobs_other_values_are_refused_by_name(switch) -> None:
    with pytest.raises(APIError, match="logprobs must be a boolean") as err:
        requested_logprobs({"logprobs": switch}, chat=True)
    assert err.value.param == "logprobs"


def test_top_logprobs_with_logprobs_0_is_refused() -> None:
    with pytest.raises(APIError, match="top_logprobs needs logprobs: true"):
        requested_logprobs({"logprobs": 0, "top_logprobs": 2}, chat=True)
