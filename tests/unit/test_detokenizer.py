"""The incremental detokenizer (engine/detokenizer.py; the router's and the offline
LLM's) and stop strings, on one-character-per-token and one-byte-per-token tokenizers.
tests/unit/test_detokenizer_agreement.py runs both front ends on the same streams."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.detokenizer import Detokenizer


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


class WordTokenizer:
    """Token i is WORDS[i]: several characters at once, so stop strings can tie."""

    WORDS = ["x", "ab", "yab"]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.WORDS[i] for i in ids)


@pytest.mark.parametrize("stop,expected", [(["ab", "a"], "xab"), (["a", "ab"], "xa"), (["b", "ab"], "xab"),
                                           (["yab", "ab"], "xyab")])
def test_stop_strings_found_at_one_place_the_first_listed_wins(stop: list[str], expected: str) -> None:
    """Two stop strings at the same place: the first listed decides the cut (with
    include_stop_str_in_output); one that starts earlier still wins over both."""
    detok = Detokenizer(WordTokenizer(), stop, include_stop=True)
    out, stopped = detok.add([0])
    delta, stopped = detok.add([2 if "yab" in stop else 1])
    assert (out + delta, stopped) == (expected, True)


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
    assert detok.add(list(b"Paris")) == ("Paris", False)
    # "." and the first byte of a two-byte character arrive together: the stop is found now,
    # not once the character completes (the request might end here).
    assert detok.add(list(b".") + [0xC3]) == ("", True)
    assert detok.text == "Paris" and detok.flush() == ""


# --- min_tokens: no stop string in the text the first min_tokens - 1 tokens complete ---------

def stream(detok: Detokenizer, batches: list[list[int]]) -> tuple[str, bool]:
    out = ""
    for batch in batches:
        delta, stopped = detok.add(batch)
        out += delta
        if stopped:
            return out, True
    return out + detok.flush(), False


def chars(text: str, sizes: list[int] | None = None) -> list[list[int]]:
    """`text` as batches of one-character tokens (each batch `sizes[i]` long, else 1)."""
    ids = list(map(ord, text))
    sizes = sizes or [1] * len(ids)
    out, i = [], 0
    for n in sizes:
        out.append(ids[i:i + n])
        i += n
    return out + ([ids[i:]] if i < len(ids) else [])


@pytest.mark.parametrize("min_tokens,expected", [
    (0, ("a", True)), (2, ("a", True)),  # "." is the 2nd token: it counts
    (3, ("a.b", True)),  # the first "." is exempt, the second is the 4th token
    (5, ("a.b.c", False)),  # both exempt
])
def test_no_stop_string_before_min_tokens(min_tokens: int, expected: tuple[str, bool]) -> None:
    assert stream(Detokenizer(CharTokenizer(), ["."], min_tokens=min_tokens), chars("a.b.c")) == expected


def test_a_stop_string_that_ends_after_the_exempt_text_counts() -> None:
    # "xy" starts in the first two tokens (exempt) and ends in the third.
    assert stream(Detokenizer(CharTokenizer(), ["xy"], min_tokens=3), chars("axyz")) == ("a", True)
    # Ending in the exempt text, it does not; a later one does.
    assert stream(Detokenizer(CharTokenizer(), ["xy"], min_tokens=4), chars("axyzxyw")) == ("axyz", True)
    # A short stop string inside the exempt text is not found because a longer one is also asked for.
    assert stream(Detokenizer(CharTokenizer(), ["x", "long stop"], min_tokens=3), chars("axbc")) == ("axbc", False)


@pytest.mark.parametrize("sizes", [[1] * 9, [9], [2, 3, 4], [3, 1, 5], [4, 5]])
def test_how_tokens_are_batched_does_not_change_the_min_tokens_cut(sizes: list[int]) -> None:
    """A batch that crosses the min_tokens-th token is decoded as if its tokens came
    one at a time."""
    for min_tokens, expected in [(4, "a.b"), (2, "a"), (6, "a.b.c"), (9, "a.b.c.d.e")]:
        detok = Detokenizer(CharTokenizer(), ["."], min_tokens=min_tokens)
        assert stream(detok, chars("a.b.c.d.e", sizes))[0] == expected, (sizes, min_tokens)


@pytest.mark.parametrize("sizes", [[1] * 6, [6], [2, 4], [3, 3]])
def test_a_batch_ends_at_the_token_that_completes_a_stop_string(sizes: list[int]) -> None:
    """Tokens that come several at once (a speculative step) end where they would one
    at a time: at the token that completes the first stop string found, the rest not
    taken (num_tokens: the offline LLM cuts its token ids there)."""
    detok = Detokenizer(CharTokenizer(), ["bcd", "c"])
    assert stream(detok, chars("abcdef", sizes)) == ("ab", True)
    assert detok.num_tokens == 3


def test_a_character_completed_at_min_tokens_is_not_exempt() -> None:
    """"é" is two byte tokens: the first before min_tokens, the second at it. The
    character is made by the min_tokens-th token, so a stop string ending in it counts;
    "x" and "y" came whole before it and do not."""
    e = list("é".encode())
    detok = Detokenizer(ByteTokenizer(), ["é", "x", "y"], min_tokens=4)
    assert stream(detok, [[ord("x")], [ord("y"), e[0]], [e[1]], [ord("x")]]) == ("xy", True)
    # Held back behind the partial character its own token ends with, "y" is still exempt.
    detok = Detokenizer(PieceTokenizer([b"x", b"y" + bytes(e[:1]), bytes(e[1:]), b"y"]), ["y"], min_tokens=3)
    assert stream(detok, [[0], [1], [2], [3]]) == ("xy\u00e9", True)


class PieceTokenizer:
    """Token i is pieces[i], any bytes (as a byte-level BPE token may be)."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def test_the_detokenizer_loads_no_torch() -> None:
    """The router imports it, and the router must not load torch. (Loaded by path: the
    engine package's __init__ is not the module's to answer for.)"""
    code = ("import importlib.util, sys\n"
            "spec = importlib.util.spec_from_file_location('detokenizer', 'engine/detokenizer.py')\n"
            "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
            "assert 'torch' not in sys.modules, 'engine/detokenizer.py loads torch'\n")
    subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2], check=True)
