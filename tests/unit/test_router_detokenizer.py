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
