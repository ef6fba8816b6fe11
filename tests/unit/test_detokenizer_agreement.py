"""The two front ends turn the same token stream into the same text: the offline
engine's OutputProcessor (as LLM.generate drives it, one token per step) and the
router's Router.run (fed by a scripted decode worker over ZMQ, one token per message,
as a decode worker sends them). Both must equal a brute-force reading of the rules:
re-decode every prefix of the stream, stop at the first prefix holding a stop string
that ends past the characters the first min_tokens - 1 tokens completed, cut before
its earliest such occurrence (after it with include_stop_str_in_output).

Streams use the tiny models' byte-level BPE: whole-word tokens, single-byte tokens that
split multi-byte characters, special tokens (skipped), and random ids (invalid UTF-8)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from cluster.config import ClusterConfig
from cluster.serve import router_for
from engine.llm import load_tokenizer
from engine.output_processor import OutputProcessor
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from protocol import WORKER_MESSAGES, Generate, Tokens, encode

PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> Any:
    return load_tokenizer(str(llama_dir))


def byte_ids(tokenizer: Any) -> list[int]:
    """The token of each byte value (a byte-level BPE has one per byte): GPT-2's
    byte -> printable character map, looked up in the vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    char = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}
    return [tokenizer.convert_tokens_to_ids(char[b]) for b in range(256)]


def text_of(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def expected(tokenizer: Any, stream: list[int], params: SamplingParams) -> tuple[str, str]:
    """(text, finish_reason) by the rules, from whole decodes of every prefix."""
    m = params.min_tokens
    exempt = len(text_of(tokenizer, stream[:m - 1]).rstrip("\ufffd")) if m > 1 else 0
    for k in range(max(m, 1), len(stream) + 1):
        text = text_of(tokenizer, stream[:k])
        hits = [(i, s) for s in params.stop if (i := text.find(s, max(0, exempt - len(s) + 1))) != -1]
        if hits:
            i, s = min(hits)
            return text[:i + len(s) if params.include_stop_str_in_output else i], "stop"
    return text_of(tokenizer, stream), "length"


def engine_path(tokenizer: Any, stream: list[int], params: SamplingParams) -> tuple[str, str]:
    """What LLM._run does with each step's advanced and finished requests, the core
    replaced by appending the stream one token per step (ending it "length" at
    max_tokens, as the scheduler does)."""
    outputs = OutputProcessor(tokenizer)
    request = Request("r", PROMPT, params)
    outputs.add(request, None)
    for token in stream:
        request.append_output_token(token)
        if request.num_output_tokens == params.max_tokens:
            request.status = RequestStatus.FINISHED_LENGTH
        if outputs.check_stop_strings([request]) and not request.status.finished:
            request.status = RequestStatus.FINISHED_STOPPED  # core.finish_stopped
        if request.status.finished:
            break
    out = outputs.finish(request)
    return out.text, out.finish_reason


class ScriptedWorker:
    """A decode worker that answers the next "generate" with `stream`, one token per
    "tokens" message, ending "length"."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"

    async def play(self, stream: list[int]) -> None:
        while True:  # skip the aborts the router sent after earlier streams' stop strings
            sender, payload = await self.sock.recv_multipart()
            msg = WORKER_MESSAGES.decode(payload)
            if isinstance(msg, Generate):
                break
        assert msg.prompt == PROMPT and msg.params.max_tokens == len(stream)
        for i, token in enumerate(stream):
            done = i == len(stream) - 1
            await self.sock.send_multipart([sender, encode(Tokens(
                request_id=msg.request_id, tokens=[token], finished=done, reason="length" if done else "",
                cached=0, phases={"queue": 0.0, "prefill": 0.0, "decode": 0.0} if done else {}))])


def router_paths(llama_dir: Path, cases: list[tuple[list[int], SamplingParams]]) -> list[tuple[str, str]]:
    """Each case through Router.run: the text its chunks add up to, and the last
    chunk's finish_reason."""
    config = ClusterConfig.from_dict({"model": str(llama_dir), "prefill": {"replicas": 0}})

    async def main() -> list[tuple[str, str]]:
        ctx = zmq.asyncio.Context()
        worker = ScriptedWorker(ctx)
        router = router_for(config, {"decode-0": worker.address})
        reader = asyncio.create_task(router.pool.decode["decode-0"].read_forever())
        results = []
        try:
            for stream, params in cases:
                player = asyncio.create_task(worker.play(stream))
                text, reason = "", None
                async for chunk in router.run(PROMPT, params):
                    text += chunk.text
                    reason = chunk.finish_reason
                results.append((text, reason))
                player.cancel()  # after a stop string, the rest of the stream is not read
        finally:
            reader.cancel()
            for client in router.pool.decode.values():  # the router's context is the process's: not ours to end
                client.sock.close(0)
            ctx.destroy(linger=0)
        return results
    return asyncio.run(asyncio.wait_for(main(), 60))


def named_cases(tokenizer: Any) -> list[tuple[list[int], SamplingParams, tuple[str, str]]]:
    """(stream, params, the text and finish_reason the rules give)."""
    byte = byte_ids(tokenizer)

    def tokens(*parts: str | bytes | int) -> list[int]:
        """str: BPE-encoded; bytes: one token per byte; int: that id."""
        out: list[int] = []
        for p in parts:
            out += (tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str)
                    else [byte[b] for b in p] if isinstance(p, bytes) else [p])
        return out

    capital = tokens(" The capital of France is Paris. The quick brown fox.")
    whole = " The capital of France is Paris. The quick brown fox."
    n_paris = len(tokens(" The capital of France is Paris"))
    accents = tokens(" Gr", "üße".encode(), ", ", "世界".encode(), "! The end. ", "🙂".encode(), " fox.")
    n_before_smiley = len(tokens(" Gr", "üße".encode(), ", ", "世界".encode(), "! The end. "))
    specials = tokens(" The", tokenizer.bos_token_id, " capital", tokenizer.eos_token_id, " is Paris.")

    def case(stream: list[int], text: str, reason: str, **kw: Any) -> tuple[list[int], SamplingParams,
                                                                             tuple[str, str]]:
        return stream, SamplingParams(max_tokens=len(stream), **kw), (text, reason)
    return [
        case(capital, whole, "length"),
        case(capital, " The capital of France is ", "stop", stop=["Paris"]),
        case(capital, " The capital of France is Paris", "stop", stop=["Paris"], include_stop_str_in_output=True),
        case(capital, " The capital of France ", "stop", stop=["is Par"]),  # spans tokens
        case(capital, " ", "stop", stop=["fox", "The"]),  # the earliest wins, whatever the order
        # min_tokens: "Paris" ends in the exempt text (the first n_paris tokens'), so the
        # first " The" after it is exempt too; "Paris. The" starts in it and ends after.
        case(capital, " The capital of France is Paris. ", "stop", stop=["The", "Paris"], min_tokens=n_paris + 1),
        case(capital, " The capital of France is ", "stop", stop=["Paris. The"], min_tokens=n_paris + 1),
        case(capital, whole, "length", stop=["The", "fox"], min_tokens=len(capital)),  # all exempt
        case(capital, whole[:-1], "stop", stop=["."], min_tokens=len(capital)),  # the last token counts
        # Multi-byte characters split into one token per byte.
        case(accents, " Grüße, ", "stop", stop=["世界"]),
        case(accents, " Grüß", "stop", stop=["ß"], include_stop_str_in_output=True),
        case(accents, " Grüße, 世", "stop", stop=["界!"], min_tokens=5),
        case(accents, " Grü", "stop", stop=["The", "ße"], min_tokens=len(tokens(" Gr", "üß".encode())) + 1),
        # 🙂 is completed by its fourth byte: at min_tokens it counts; before, it is exempt.
        case(accents, " Grüße, 世界! The end. ", "stop", stop=["🙂"], min_tokens=n_before_smiley + 4),
        case(accents, " Grüße, 世界! The end. 🙂 fox.", "length", stop=["🙂"], min_tokens=n_before_smiley + 5),
        # Special tokens are skipped (in between too), and no stop string matches their spelling.
        case(specials, " The ", "stop", stop=["capital is"]),
        case(specials, " The capital is Paris.", "length", stop=["<s>", "</s>"]),
        case(tokens("caf", "é".encode()[:1], " bar."), "caf\ufffd bar.", "length"),  # invalid UTF-8
    ]


def random_cases(tokenizer: Any, n: int) -> list[tuple[list[int], SamplingParams]]:
    byte = byte_ids(tokenizer)
    words = ["The", " capital", " of", " France", " is", " Paris", ".", " fox", " Grüße", " 世界", " 🙂",
             " naïve", " €5", "\n"]
    rng = random.Random(0)
    cases = []
    for _ in range(n):
        stream: list[int] = []
        while len(stream) < 24:
            w = rng.choice(words)
            r = rng.random()
            stream += ([byte[b] for b in w.encode()] if r < 0.3
                       else [rng.randrange(tokenizer.vocab_size)] if r < 0.4
                       else tokenizer.encode(w, add_special_tokens=False))
        text = text_of(tokenizer, stream)
        stops = []
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(text) - 1)
            stops.append(text[i:i + rng.randint(1, 4)] if rng.random() < 0.8 else rng.choice(words).strip() or "x")
        cases.append((stream, SamplingParams(max_tokens=len(stream), stop=stops, min_tokens=rng.randint(0, len(stream)),
                                             include_stop_str_in_output=rng.random() < 0.5)))
    return cases


@pytest.mark.timeout(120)
def test_engine_and_router_turn_the_same_stream_into_the_same_text(llama_dir: Path, tokenizer: Any) -> None:
    named, randomised = named_cases(tokenizer), random_cases(tokenizer, 60)
    for stream, params, want in named:  # the rules say what each case says
        assert expected(tokenizer, stream, params) == want, (params, want)
    cases = [(stream, params) for stream, params, _ in named] + randomised
    want = [expected(tokenizer, stream, params) for stream, params in cases]
    engine = [engine_path(tokenizer, stream, params) for stream, params in cases]
    router = router_paths(llama_dir, cases)
    for (stream, params), w, e, r in zip(cases, want, engine, router):
        assert e == w and r == w, (text_of(tokenizer, stream), params.stop, params.min_tokens, w, e, r)
    # The random streams hit every rule: stop strings found, and some found only
    # without min_tokens.
    assert sum(reason == "stop" for _, reason in want[len(named):]) >= 20
    assert sum(expected(tokenizer, s, dataclasses.replace(p, min_tokens=0)) != w
               for (s, p), w in zip(randomised, want[len(named):])) >= 10
