"""Cost of the typed worker protocol (protocol/) per message, against bare msgpack of
the same fields (no types checked: the floor) in the same run.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.serving protocol_codec --repeats 5

The messages are the ones on the hot path: a decode step's Tokens for one request (one
token; and 8 tokens with top-5 logprobs), and a Generate with a 1,000-token prompt.
Prints microseconds per encode + decode, the median of --repeats runs of --number each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import msgpack  # noqa: E402
import msgspec  # noqa: E402

from engine.sampling_params import SamplingParams  # noqa: E402
from protocol import WORKER_MESSAGES, Generate, Tokens, encode  # noqa: E402


def cases() -> dict[str, Tokens | Generate]:
    top = [(t, -0.5 * t) for t in range(5)]
    return {
        "Tokens, 1 token": Tokens(request_id="9f1c2e4a7b3d", tokens=[1234], finished=False, reason="", cached=0),
        "Tokens, 8 tokens + top-5 logprobs": Tokens(request_id="9f1c2e4a7b3d", tokens=list(range(8)), finished=False,
                                                    reason="", cached=0, logprobs=[(-0.25, top)] * 8),
        "Generate, 1000-token prompt": Generate(request_id="9f1c2e4a7b3d", prompt=list(range(1000)),
                                                params=SamplingParams(max_tokens=128, temperature=0.0), remote=True),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--number", type=int, default=20000)
    args = p.parse_args()
    print(f"{'message':36} {'typed us':>9} {'msgpack us':>10} {'ratio':>6}")
    for name, message in cases().items():
        plain = {"kind": message.kind, **msgspec.to_builtins(message)}
        typed_s = timeit.repeat(lambda: WORKER_MESSAGES.decode(encode(message)), number=args.number,
                                repeat=args.repeats)
        plain_s = timeit.repeat(lambda: msgpack.unpackb(msgpack.packb(plain)), number=args.number,
                                repeat=args.repeats)
        typed, bare = (statistics.median(t) / args.number * 1e6 for t in (typed_s, plain_s))
        print(f"{name:36} {typed:9.2f} {bare:10.2f} {typed / bare:6.2f}")


if __name__ == "__main__":
    main()
