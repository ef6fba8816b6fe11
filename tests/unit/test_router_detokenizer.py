"""The router's incremental detokenizer and stop strings, on a one-character-per-token
tokenizer."""

from __future__ import annotations

import pytest

from router.detokenizer import Detokenizer


class CharTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


def run(text: str, stop: list[str], include_stop: bool) -> tuple[str, bool]:
    detok = Detokenizer(CharTokenizer(), stop, include_stop)
    out = ""
    for ch in text:
        delta, stopped = detok.add([ord(ch)])
        out += delta
        if stopped:
            return out, True
    return out + detok.flush(), False


@pytest.mark.parametrize("include_stop,expected", [(False, " Paris"), (True, " Paris.")])
def test_stop_string_is_cut_or_kept(include_stop: bool, expected: str) -> None:
    assert run(" Paris. The answer", ["."], include_stop) == (expected, True)


def test_the_earliest_stop_string_wins() -> None:
    assert run("one two three", ["three", "two"], True) == ("one two", True)
    assert run("one two three", ["three", "two"], False) == ("one ", True)
    assert run("one two three", ["four"], False) == ("one two three", False)


def test_incremental_text_equals_a_decode_of_every_token(llama_dir) -> None:
    """A byte-level BPE tokenizer (the tiny models'), text with multi-byte characters
    split across tokens (and random ids: invalid UTF-8 too), tokens arriving 1-3 at a
    time: the deltas add up to the decode of all of them."""
    import random

    from engine.llm import load_tokenizer

    tokenizer = load_tokenizer(str(llama_dir))
    text = "Grüße, 世界! Emoji 🙂🚀 and plain words: the end. " * 3
    ids = tokenizer.encode(text)
    rng = random.Random(0)
    for _ in range(5):
        ids_mixed = ids + [rng.randrange(tokenizer.vocab_size) for _ in range(40)]
        detok, out, i = Detokenizer(tokenizer, []), "", 0
        while i < len(ids_mixed):
            n = rng.randint(1, 3)
            delta, _ = detok.add(ids_mixed[i:i + n])
            out += delta
            i += n
        assert out + detok.flush() == tokenizer.decode(ids_mixed, skip_special_tokens=True)


class ByteTokenizer:
    """One token per UTF-8 byte, decoded as a byte-level BPE decodes (replacement
    characters for incomplete sequences)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_a_stop_string_before_a_partial_character_is_found_in_the_same_step() -> None:
    detok = Detokenizer(ByteTokenizer(), ["."])
    assert detok.add(list("Paris".encode())) == ("Paris", False)
    # "." and the first byte of a two-byte character arrive together: the stop is found now,
    # not once the character completes (the request might end here).
    assert detok.add(list(".".encode()) + [0xC3]) == ("", True)
    assert detok.text == "Paris" and detok.flush() == ""
