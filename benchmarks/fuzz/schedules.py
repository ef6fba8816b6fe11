"""Run the schedule fuzzers (tests/fuzz/harness.py) over many seeds.

    .venv/bin/python -m benchmarks.fuzz schedules --fuzzer offline --seeds 1000
    .venv/bin/python -m benchmarks.fuzz schedules --fuzzer pd --transport shm --seeds 1000 --time-limit 900
    .venv/bin/python -m benchmarks.fuzz schedules --fuzzer pd --transport tcp --seeds 200 --dump-dir /tmp/fz
    .venv/bin/python -m benchmarks.fuzz schedules --replay /tmp/fz/pd-tcp-17.json --shrink
    .venv/bin/python -m benchmarks.fuzz schedules --fuzzer offline --tp 2 --seeds 100
    .venv/bin/python -m benchmarks.fuzz schedules --fuzzer pd --transport shm --tp random --seeds 100
    .venv/bin/python -m benchmarks.fuzz schedules --fuzzer offline --structured 0.5 --seeds 300
    .venv/bin/python -m benchmarks.fuzz schedules --fuzzer tiers --seeds 1000
    .venv/bin/python -m benchmarks.fuzz schedules --fuzzer pd --kv-cache-dtype fp8 --tp random --seeds 100
    .venv/bin/python -m benchmarks.fuzz schedules --fuzzer pd --transport tcp --stream off --seeds 1000
    .venv/bin/python -m benchmarks.fuzz schedules --fuzzer offline --lora 0.5 --seeds 300

Prints one line per failure: seed, kind (mismatch / exception / hang / error_finish /
invariant / rejection / constraint), a tag when it looks like a known bug (F1-F4; F3 on
a mismatch means some write's bytes landed after deadline + cancel_grace_s in that seed;
F3-detected: D itself failed a request a late write overwrote; S1: a json_object output
that is a JSON array), and details (a hang
comes with both engines' state). Then one summary line: seeds, requests, mismatches,
exceptions, hangs, other kinds, known tags, failed seeds, seconds, and how often the
interesting paths ran (preemptions, fallbacks, expiries, ...; with --structured, how
many requests were constrained and how many of those the oracle ends "stop"). Exit status 1 if
anything failed.

Builds the tiny seeded Llama (tests/tiny_models.py) in a temporary directory; no
download. The oracle is each request alone in a roomy colocated engine; its greedy
tokens are checked against Hugging Face transformers on a few prompts first
(--no-hf-check to skip). P/D copies are slowed without bound by default (a stalled
host); --bounded-copies keeps a started copy within the transport's bounds, as the
short test in tests/fuzz does.

--stream off|chunk|layer sets transport_options.stream for every pd seed (layer: chunk
where the prefill engine is at TP > 1); by default each seed draws it (chunk and layer
twice as often as off), a stream_min_tokens of 0, 16 or 48 and a stream_layers of 1 or
2, from a random stream of its own, so the rest of a seed's schedule is the same in
every mode.

--kv-cache-dtype fp8 (or fp8_e5m2) gives every engine, the oracle's too, an fp8 KV
cache, and --quantization fp8 fp8 weights: not comparable to HF's tokens (--no-hf-check
is implied), but every schedule must give that configuration's colocated engine's (the
model rounds K/V before they are stored, engine/attention/kv_quant.py; the weights are
quantized the same at any TP size, engine/model/fp8_linear.py).

--fuzzer tiers: offline schedules for the KV offload tiers (tests/fuzz/tiers.py):
multi-turn conversations into a device pool of about one request, tiers of a few blocks,
a disk tier half the time, aborts while loads run; besides the tokens, every tier slot
must be an entry's and none pinned once the seed is over (tier_loads counts the loads).

--tp runs the fuzzed engines tensor-parallel (one torch thread per rank; the oracle
stays TP 1): offline `--tp P`; pd `--tp P,D` (prefill TP P, decode TP D) or `--tp
random`, a pair from {1,2}x{1,2} drawn per seed (the seed's schedule is the same at
any TP). Every engine is closed at the end of its seed, failed or hung; a follower
process still alive after a seed is reported (kind invariant), and the summary says
how many were left at the end (followers_left, 0 expected).

--structured FRACTION gives about that fraction of each seed's requests a
structured_outputs constraint (tests/fuzz/structured.py: JSON schemas, json_object,
regexes, choices, small EBNF grammars; greedy or seeded-sampled, on top of whatever else
the request draws; some get a larger max_tokens where it still fits); the seed's engine
config, prompts, arrivals and aborts are the same as without (0, the default: exactly
the cases without it). Their tokens must equal the oracle's, and one that
finishes "stop" must obey its constraint (kind constraint: jsonschema, re.fullmatch,
choice membership, the grammar's regular equivalent, on the detokenized text).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# c10d's store polling while TP followers start logs a warning a second (noise here)
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
import torch  # noqa: E402

if not torch.cuda.is_available():  # before anything defines a @triton.jit kernel
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(1)

from tests.fuzz import harness as H  # noqa: E402
from tests.tiny_models import build_tiny_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fuzzer", choices=("offline", "pd", "tiers"), default="offline")
    ap.add_argument("--transport", choices=("shm", "tcp"), default="shm", help="pd only")
    ap.add_argument("--stream", choices=("drawn", "off", "chunk", "layer"), default="drawn",
                    help="pd only: transport_options.stream for every seed (drawn: per seed, chunk, layer or off)")
    ap.add_argument("--tp", default="1",
                    help="tensor_parallel_size of the fuzzed engines: offline P; pd P,D (prefill, decode), "
                         "P (both), or random (a pair from {1,2}x{1,2} per seed)")
    ap.add_argument("--structured", type=float, default=0.0, metavar="FRACTION",
                    help="give about this fraction of the requests a structured_outputs constraint "
                         "(0: none, today's cases exactly)")
    ap.add_argument("--lora", type=float, default=0.0, metavar="FRACTION",
                    help="offline: about this fraction of the requests name one of three LoRA adapters "
                         "(tests/lora_adapters.py, built for the model; 0: none, today's cases exactly)")
    ap.add_argument("--seeds", type=int, default=100, help="how many seeds")
    ap.add_argument("--start", type=int, default=0, help="first seed")
    ap.add_argument("--time-limit", type=float, default=0.0,
                    help="stop starting new seeds after this many seconds (0: no limit)")
    ap.add_argument("--bounded-copies", action="store_true",
                    help="pd: a started shm copy never outlasts cancel_grace_s / 4 (as the short test runs); "
                         "default: unbounded, where D may rightly fail requests a late write overwrote")
    ap.add_argument("--seed-wall-limit", type=float, default=30.0,
                    help="a seed still running after this many seconds is a hang")
    ap.add_argument("--model-dir", default="", help="an existing tiny model directory (default: build one)")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="every engine's, the oracle's too (its colocated greedy tokens are then the fp8 engine's)")
    ap.add_argument("--quantization", default=None, choices=("fp8",),
                    help="every engine's weights, the oracle's too (engine/model/fp8_linear.py)")
    ap.add_argument("--no-hf-check", action="store_true", help="skip the oracle-vs-transformers check")
    ap.add_argument("--dump-dir", default="", help="write each failing seed's case as JSON here")
    ap.add_argument("--progress", type=int, default=0, help="print a progress line every N seeds")
    ap.add_argument("--replay", default="", help="rerun one case dumped by --dump-dir (a JSON file) and exit")
    ap.add_argument("--shrink", action="store_true",
                    help="with --replay: drop requests while its first failure's kind persists; print the case")
    ap.add_argument("-v", "--verbose", action="store_true", help="keep the engine's and transports' warnings")
    args = ap.parse_args()

    if not args.verbose:  # late writes dropped or overwritten, fallbacks: expected under fuzzing
        logging.disable(logging.ERROR)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        try:
            from transformers.utils import logging as hf_logging
            hf_logging.disable_progress_bar()
        except ImportError:
            pass
    tmp = None
    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        tmp = Path(tempfile.mkdtemp(prefix="pdserve-fuzz-"))
        model_dir = build_tiny_model("llama", tmp / "llama")
    try:
        return run(args, model_dir)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def parse_tp(text: str, fuzzer: str) -> int | tuple[int, int] | str:
    """--tp: offline an int; pd a (prefill, decode) pair, or "random"."""
    if fuzzer in ("offline", "tiers"):
        return int(text)
    if text == "random":
        return text
    sizes = [int(x) for x in text.split(",")]
    if len(sizes) not in (1, 2):
        raise SystemExit(f"--tp {text!r}: P,D or P or random for the pd fuzzer")
    return (sizes[0], sizes[-1])


def replay(args: argparse.Namespace, model_dir: Path, oracle: H.Oracle) -> int:
    with open(args.replay) as fh:
        case = H.case_from_dict(json.load(fh)["case"])
    res = H.run_case(case, model_dir, oracle, wall_limit=args.seed_wall_limit)
    for f in res.failures:
        print(f.line(), flush=True)
    if args.shrink and res.failures:
        small = H.shrink(case, model_dir, oracle, res.failures[0].kind, tries=3 if isinstance(case, H.PDCase) else 1,
                         wall_limit=args.seed_wall_limit)
        print("shrunk case:", json.dumps(H.case_dict(small)), flush=True)
    print(f"replay failures={len(res.failures)} requests={res.requests} seconds={res.seconds:.1f}")
    return 1 if res.failures else 0


def run(args: argparse.Namespace, model_dir: Path) -> int:
    t_start = time.monotonic()
    from tests.fuzz.common import ENGINE_OPTIONS

    if args.kv_cache_dtype != "auto":
        ENGINE_OPTIONS["kv_cache_dtype"] = args.kv_cache_dtype
    if args.quantization:
        ENGINE_OPTIONS["quantization"] = args.quantization
    if args.lora:
        from tests.fuzz import lora

        lora.use(model_dir, Path(tempfile.mkdtemp(prefix="pdserve-fuzz-lora-")))
    oracle = H.Oracle(model_dir)
    if args.replay:
        return replay(args, model_dir, oracle)
    counts: Counter[str] = Counter()
    known: Counter[str] = Counter()
    stats: Counter[str] = Counter()
    failed_seeds: list[int] = []
    seeds = requests = 0

    if not args.no_hf_check and not ENGINE_OPTIONS:
        case = H.make_offline_case(args.start)
        sample = [s.prompt for s in case.requests][:3]
        for line in H.hf_agreement(model_dir, oracle, sample):
            print(f"oracle kind=hf_disagreement {line}", flush=True)
            counts["hf_disagreement"] += 1

    def on_alarm(signum, frame):  # a single call that never returns
        raise H.Hang(f"watchdog: the seed ran past {args.seed_wall_limit + 30:.0f} s inside one call")

    signal.signal(signal.SIGALRM, on_alarm)
    tp = parse_tp(args.tp, args.fuzzer)
    label = args.fuzzer if args.fuzzer != "pd" else f"pd/{args.transport}"
    if args.kv_cache_dtype != "auto":
        label += f"/{args.kv_cache_dtype}"
    if args.quantization:
        label += f"/w{args.quantization}"
    if args.tp != "1":
        label += f"/tp{args.tp}"
    if args.fuzzer == "pd" and args.stream != "drawn":
        label += f"/stream-{args.stream}"
    if args.structured:
        label += f"/structured{args.structured:g}"
    if args.lora:
        label += f"/lora{args.lora:g}"
    for seed in range(args.start, args.start + args.seeds):
        if args.time_limit and time.monotonic() - t_start > args.time_limit:
            break
        if args.fuzzer != "pd":
            case = (H.make_offline_case if args.fuzzer == "offline" else H.make_tier_case)(seed, tp=tp)
            where = ""
        else:
            pair = H.draw_tp_pair(seed, args.transport) if tp == "random" else tp
            case = H.make_pd_case(seed, args.transport, bounded_copies=args.bounded_copies, tp=pair)
            where = f"tp={pair[0]},{pair[1]} " if tp == "random" else ""
            if tp == "random":
                stats[f"seeds_tp{pair[0]},{pair[1]}"] += 1
            if args.stream != "drawn":
                case.stream = "chunk" if args.stream == "layer" and pair[0] > 1 else args.stream
            stats[f"seeds_stream_{case.stream}"] += 1
        H.add_structured(case, args.structured)
        if args.lora:
            lora.add_loras(case, args.lora)
            stats["lora_requests"] += sum(s.lora is not None for s in case.requests)
        # the wall limit runs from when the engines are up: TP groups take long to start
        signal.alarm(int(args.seed_wall_limit + 30 + (60 if args.tp != "1" else 0)))
        try:
            res = H.run_case(case, model_dir, oracle, wall_limit=args.seed_wall_limit)
        finally:
            signal.alarm(0)
        if args.structured:  # constrained requests, and those the oracle ends "stop" (checked against it)
            constrained = [s for s in case.requests if "structured_outputs" in s.params]
            stats["structured"] += len(constrained)
            stats["structured_stop"] += sum(oracle.expect(s)[1] == "stop" for s in constrained)
        left = H.live_followers()
        if left:  # every engine is closed at the end of its seed
            res.failures.append(H.Failure(seed, "invariant", f"follower processes {left} still alive after the seed"))
        seeds += 1
        requests += res.requests
        stats.update(res.stats)
        for f in res.failures:
            print(f"{label} {where}{f.line()}", flush=True)
            counts[f.kind] += 1
            if f.known:
                known[f.known] += 1
        if res.failures:
            failed_seeds.append(seed)
            if args.dump_dir:
                Path(args.dump_dir).mkdir(parents=True, exist_ok=True)
                name = f"{args.fuzzer}-{seed}" if args.fuzzer != "pd" else f"pd-{args.transport}-{seed}"
                if args.tp != "1":
                    name += "-tp" + "-".join(str(x) for x in ((tp,) if args.fuzzer != "pd" else pair))
                with open(Path(args.dump_dir) / f"{name}.json", "w") as fh:
                    json.dump({"case": H.case_dict(case), "failures": [f.line() for f in res.failures]}, fh)
        if args.progress and seeds % args.progress == 0:
            print(f"progress {label} seeds={seeds} last={seed} failures={sum(counts.values())} "
                  f"seconds={time.monotonic() - t_start:.0f}", flush=True)
    seconds = time.monotonic() - t_start
    other = sum(v for k, v in counts.items() if k not in ("mismatch", "exception", "hang"))
    print(f"summary fuzzer={label} seeds={seeds} (from {args.start}) requests={requests} "
          f"mismatches={counts['mismatch']} exceptions={counts['exception']} hangs={counts['hang']} "
          f"other={other} ({', '.join(f'{k}={v}' for k, v in sorted(counts.items())) or 'none'}) "
          f"known={dict(sorted(known.items()))} failed_seeds={failed_seeds[:50]}{'...' if len(failed_seeds) > 50 else ''} "
          f"seconds={seconds:.1f} oracle_seconds={oracle.seconds:.1f} followers_left={len(H.live_followers())} "
          f"exercised={dict(sorted(stats.items()))}", flush=True)
    return 1 if counts else 0


if __name__ == "__main__":
    sys.exit(main())
