"""Multi-turn chat served with the KV cache hierarchy off and on (issue 37), in one run.

    .venv/bin/python -m benchmarks.serving multi_turn                       # off vs host, 3 repeats
    .venv/bin/python -m benchmarks.serving multi_turn --arms off,host,disk --json results/multi-turn.json
    .venv/bin/python -m benchmarks.serving multi_turn --no-reuse            # every prompt new: the tiers' cost

Each arm serves --config (configs/local-kv-tier.yaml) with every pool's device KV pool
cut to --pool-gib and its kv_offload_* options set by the arm:
  off   no tiers (kv_offload_gib 0): an evicted block is computed again
  host  a --host-gib host tier
  disk  a --disk-host-gib host tier written through to a --disk-gib disk tier (a temporary
        directory), so most hits come back from files
  shared  the host tier, and below it the config's kv_store (--store-gib) both workers share
--conversations chats share a --system-words system prompt; each has --turns turns of
--user-words new words and a --answer-tokens answer (ignore_eos), sent to
/v1/chat/completions with the whole history, as a chat client does. --concurrency
requests are in flight at a time, taken turn-major (every conversation's turn 1, then
every turn 2, ...), so between two turns of one conversation the others' KV passes
through the pool: the working set is --conversations times a conversation's context,
which the command prints next to the device pool's size. With --no-reuse each request
is a one-turn chat with a system prompt of its own: no prefix to find in any tier.

Each repeat starts a fresh deployment per arm, the arms interleaved (off, host, off,
host, ...); the table gives the median over repeats of each figure:
  TTFT p50/p99  request sent -> first streamed token, turn 1 included (streamed, as serve)
  req/s, tok/s  requests and prompt+output tokens served per second of the whole run
  cached        usage.prompt_tokens_details.cached_tokens / prompt_tokens, summed
  host, disk, shared  prompt tokens loaded back from that tier (the workers'
                pdserve_kv_tier_hits_blocks_total x block size, from the router's /metrics)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

_REPO_ROOT = Path(__file__).resolve().parents[2]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.serving.load import WORDS, _client  # noqa: E402
from benchmarks.serving.metrics_scrape import scrape  # noqa: E402
from benchmarks.serving.report import json_text, percentiles  # noqa: E402
from benchmarks.serving.server import serving  # noqa: E402

ARMS = ("off", "host", "disk", "shared")
STATS_SETTLE_S = 3.0  # the router polls worker stats about once a second: let the last poll land


@dataclasses.dataclass
class Turn:
    ttft: float = 0.0
    e2e: float = 0.0
    conversation: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def conversations(args: argparse.Namespace) -> tuple[list[str], list[list[str]]]:
    """(system prompt per conversation, user messages per conversation), from --seed."""
    rng = random.Random(args.seed)
    shared = words(rng, args.system_words)
    if args.no_reuse:  # one turn each, nothing in common
        return ([words(rng, args.system_words) for _ in range(args.conversations)],
                [[words(rng, args.user_words)] for _ in range(args.conversations)])
    return ([shared] * args.conversations,
            [[words(rng, args.user_words) for _ in range(args.turns)] for _ in range(args.conversations)])


async def chat_turn(client, url: str, model: str, messages: list[dict], max_tokens: int, turn: Turn) -> str:
    """Send one turn, streamed; fill `turn`, return the answer's text."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    text, start = [], time.perf_counter()
    async with client.stream("POST", f"{url}/chat/completions", json=body) as response:
        if response.status_code != 200:
            turn.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return ""
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                turn.error = f"stream error: {chunk['error']}"
                return ""
            if chunk.get("usage"):
                usage = chunk["usage"]
                turn.prompt_tokens, turn.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
                turn.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            for choice in chunk.get("choices", []):
                if not text and not turn.ttft:
                    turn.ttft = time.perf_counter() - start
                text.append(choice.get("delta", {}).get("content") or "")
    turn.e2e = time.perf_counter() - start
    return "".join(text)


async def run_chats(url: str, model: str, args: argparse.Namespace) -> tuple[list[Turn], float]:
    """Every conversation's turns, --concurrency at a time, turn-major; (turns, seconds)."""
    systems, users = conversations(args)
    history = [[{"role": "system", "content": s}] for s in systems]
    done = [asyncio.Event() for _ in systems]
    for event in done:
        event.set()
    order = [(c, t) for t in range(max(len(u) for u in users)) for c in range(len(users)) if t < len(users[c])]
    turns: list[Turn] = []

    async def worker(queue: list[tuple[int, int]]) -> None:
        while queue:
            c, t = queue.pop(0)
            await done[c].wait()  # the previous turn's answer is part of this prompt
            done[c].clear()
            history[c].append({"role": "user", "content": users[c][t]})
            turn = Turn(conversation=c)
            turns.append(turn)
            try:
                answer = await chat_turn(client, url, model, history[c], args.answer_tokens, turn)
            except Exception as exc:  # a benchmark reports a failure, it does not stop on one
                turn.error, answer = f"{type(exc).__name__}: {exc}", ""
            history[c].append({"role": "assistant", "content": answer})
            done[c].set()

    async with _client(None) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(order) for _ in range(args.concurrency)))
        return turns, time.perf_counter() - start


def metric_sum(metrics: str | None, name: str, **labels: str) -> int:
    """The sum of the router's /metrics samples `name` with these labels."""
    from prometheus_client.parser import text_string_to_metric_families
    total = 0.0
    for family in text_string_to_metric_families(metrics or ""):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return int(total)


def arm_config(args: argparse.Namespace, arm: str, tier_dir: Path) -> Path:
    """--config with the pools' KV options set for `arm`, written under tier_dir."""
    config = yaml.safe_load(Path(args.config).read_text())
    config.setdefault("router", {})["port"] = args.port
    config["kv_store"] = {"enabled": arm == "shared", "capacity_gib": args.store_gib}
    for pool in ("prefill", "decode"):
        engine = dict(config.get(pool, {}).get("engine", {}))
        for key in ("kv_offload_gib", "kv_offload_dir", "kv_offload_disk_gib"):
            engine.pop(key, None)
        engine["kv_cache_memory_gib"] = args.pool_gib
        if arm in ("host", "shared"):
            engine["kv_offload_gib"] = args.host_gib
        elif arm == "disk":
            engine.update(kv_offload_gib=args.disk_host_gib, kv_offload_dir=str(tier_dir / pool),
                          kv_offload_disk_gib=args.disk_gib)
        config.setdefault(pool, {})["engine"] = engine
    path = tier_dir / f"{arm}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def one_run(args: argparse.Namespace, arm: str) -> dict:
    from cluster.config import load_cluster_config
    with tempfile.TemporaryDirectory(prefix="pdserve-multi-turn-") as tmp:
        config = load_cluster_config(str(arm_config(args, arm, Path(tmp))))
        block_size = config.decode.engine.get("block_size", 16)
        with serving(config, None) as (url, model):
            turns, seconds = asyncio.run(run_chats(url, model, args))
            time.sleep(STATS_SETTLE_S)
            metrics = scrape(url)
    ok = [t for t in turns if not t.error]
    prompt = sum(t.prompt_tokens for t in ok)
    longest = {t.conversation: t.prompt_tokens for t in ok}  # turns are in order: the last one stays
    hits = {tier: metric_sum(metrics, "pdserve_kv_tier_hits_blocks_total", tier=tier) * block_size / max(prompt, 1)
            for tier in ("host", "disk", "shared")}
    return {"arm": arm, "requests": len(turns), "failed": len(turns) - len(ok),
            "errors": sorted({t.error for t in turns if t.error})[:3], "seconds": seconds,
            "ttft": percentiles([t.ttft for t in ok]),
            "request_throughput": len(ok) / seconds,
            "token_throughput": (prompt + sum(t.completion_tokens for t in ok)) / seconds,
            "prompt_tokens": prompt, "cached": sum(t.cached_tokens for t in ok) / max(prompt, 1),
            **hits, "working_set_tokens": sum(longest.values()),
            "decode_pool_tokens": metric_sum(metrics, "pdserve_worker_num_blocks", role="decode") * block_size}


def table(runs: list[dict], arms: list[str]) -> str:
    rows = ["| arm | TTFT p50 ms | TTFT p99 ms | req/s | tok/s | cached | host | disk | shared | TTFT p50 vs off |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    med = {arm: {key: statistics.median(r["ttft"][key] if key.startswith("p") else r[key]
                                        for r in runs if r["arm"] == arm)
                 for key in ("p50", "p99", "request_throughput", "token_throughput", "cached", "host", "disk",
                             "shared")}
           for arm in arms}
    for arm, m in med.items():
        vs = f"{med['off']['p50'] / m['p50']:.2f}x" if "off" in med else "-"
        rows.append(f"| {arm} | {m['p50'] * 1e3:.0f} | {m['p99'] * 1e3:.0f} | {m['request_throughput']:.2f} | "
                    f"{m['token_throughput']:.0f} | {m['cached']:.0%} | {m['host']:.0%} | {m['disk']:.0%} | "
                    f"{m['shared']:.0%} | {vs} |")
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="multi_turn", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(_REPO_ROOT / "configs" / "local-kv-tier.yaml"))
    p.add_argument("--arms", default="off,host", help=f"comma-separated, of {','.join(ARMS)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-words", type=int, default=60)
    p.add_argument("--user-words", type=int, default=20)
    p.add_argument("--answer-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--no-reuse", action="store_true", help="one-turn chats, no prefix in common")
    p.add_argument("--pool-gib", type=float, default=0.17, help="each worker's device KV pool")
    p.add_argument("--host-gib", type=float, default=1.0)
    p.add_argument("--disk-host-gib", type=float, default=0.02)
    p.add_argument("--disk-gib", type=float, default=2.0)
    p.add_argument("--store-gib", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8741)
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    args.arms = [a.strip() for a in args.arms.split(",")]
    for arm in args.arms:
        if arm not in ARMS:
            p.error(f"--arms: unknown arm {arm!r}; choose from {', '.join(ARMS)}")
    for name in ("repeats", "conversations", "turns", "system_words", "user_words", "answer_tokens", "concurrency"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("pool_gib", "host_gib", "disk_host_gib", "disk_gib", "store_gib"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    runs = []
    for repeat in range(args.repeats):
        for arm in args.arms:
            run = one_run(args, arm) | {"repeat": repeat}
            print(f"repeat {repeat} {arm}: TTFT p50 {run['ttft']['p50'] * 1e3:.0f} ms, p99 "
                  f"{run['ttft']['p99'] * 1e3:.0f} ms, {run['request_throughput']:.2f} req/s, cached "
                  f"{run['cached']:.0%} (host {run['host']:.0%}, disk {run['disk']:.0%}, shared {run['shared']:.0%}), "
                  f"{run['failed']} failed {run['errors']}; working set {run['working_set_tokens']} tokens, "
                  f"decode pool {run['decode_pool_tokens']}", flush=True)
            runs.append(run)
    print(table(runs, args.arms))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json_text({"args": vars(args), "runs": runs}))


if __name__ == "__main__":
    main()
