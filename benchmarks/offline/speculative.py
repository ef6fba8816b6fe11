"""N-gram speculative decoding against the plain engine, on CPU, in the same run.

    .venv/bin/python -m benchmarks.offline speculative --json docs/data/speculative-cpu.json
    .venv/bin/python -m benchmarks.offline speculative --quick --json /tmp/spec.json   # seconds: a smoke run

Offline engines (engine.LLM, the demo model in float32, prefix caching off so that
every repeat does the same work), one per setting, all alive at once; each group of
`batch` prompts runs on every engine in turn, in an order rotated per group, so that the
baseline and the speculative engines share the machine's moments. Medians over the
repeats of each engine's total, ratios against the baseline's median from the same run,
by wall clock and by this process's CPU time (which another process's load on a shared
machine changes least). The greedy cases must give every engine the same tokens: the
JSON's `tokens_identical` says whether they did.

Workloads (token ids built once, with the model's chat template):
  repetitive  an instruction to copy, rewrite, repeat or summarize a text of a few
              paragraphs given in the prompt; batch 1 runs `--batch1-prompts` of them one
              at a time, batch 16 all 16 (4 texts x 4 instructions) together
  random      random words from the texts, with an instruction to answer them, sampled at
              --random-temperature 1 (seeded, ignore_eos): the few drafts are rarely
              accepted, and the per-request fallback (min_acceptance_rate over
              acceptance_window) turns speculation off. Greedy or at lower temperatures
              this small model falls into loops within 256 tokens, which the drafts
              follow (try --random-temperature 0.7): not the case this one is for.

First the sweep (repetitive, batch 1): k in --ks with the default prompt lookup, and
--lookups at k = --lookup-k. Then the best of the sweep (highest median tokens/s) against
the baseline on the other cases. Acceptance rate and mean accepted length come from the
speculator's counters (engine.core.speculator.stats), taken over each case's runs.
Engine steps and Speculator.propose are timed too, in CPU time (wrappers on the engine's
instance): the speedup is the tokens gained per step over the dearer step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine import LLM, SamplingParams  # noqa: E402

DEMO_MODEL = "models/SmolLM2-135M-Instruct"
INSTRUCTIONS = ("Copy this text:", "Rewrite the following text, fixing nothing:",
                "Repeat the following text exactly, word for word:", "Summarize the following text:")


def paragraphs(text: str) -> str:
    """Each paragraph's lines joined by spaces; paragraphs apart by a blank line."""
    return "\n\n".join(" ".join(p.split()) for p in text.split("\n\n"))


# Wrapped here for reading; paragraphs() joins each paragraph's lines again.
TEXTS = tuple(paragraphs(t) for t in (
    """The harbour town of Kelsey woke slowly on winter mornings. Fishing boats that had gone out
before dawn returned by nine, and the market stalls along the quay opened only once the catch
had been sorted, weighed and priced. Visitors who arrived early found the cafes shuttered and
the streets empty except for gulls.

In 1987 the town council approved a plan to widen the harbour wall, arguing that larger vessels
would bring trade. The project ran two years late and cost nearly three times its budget, and a
storm in its final winter tore away a section of the new wall. Residents still argue about
whether it was worth it.

Today Kelsey depends as much on tourism as on fishing. A small museum in the old customs house
tells the story of the lifeboat crews, and a ferry runs twice a day to the islands in summer.
Most shops close at five, and by seven the only lights on the quay are those of the two pubs and
the harbourmaster's office.""",
    """Version 3.2 of the backup tool changes how snapshots are pruned. Until now, every snapshot older
than the retention period was deleted in one pass, which could take hours on large repositories
and left the repository locked the whole time. The new pruner works in batches of a hundred
snapshots and releases the lock between batches, so scheduled backups can run while old data is
being removed.

The configuration file keeps its format, but two keys were renamed: keep_daily is now
retain_daily, and keep_weekly is now retain_weekly. The old names still work and print a
warning. If you pin the tool's version in a deployment script, check that your monitoring does
not treat the warning as a failure.

To upgrade, stop the backup service, install the new package, and run the check command once
before starting the service again. The check reads every index file and reports any snapshot
whose chunks are missing. On a repository of two terabytes it usually finishes in under ten
minutes.""",
    """To make the bread, mix five hundred grams of strong white flour with ten grams of salt and seven
grams of dried yeast in a large bowl. Add three hundred and fifty millilitres of warm water and
a tablespoon of olive oil, then stir until the dough comes together. It will look rough and a
little sticky at first.

Turn the dough onto a lightly floured surface and knead it for about ten minutes, until it feels
smooth and springs back when you press it. Put it back in the bowl, cover it with a damp cloth,
and leave it somewhere warm for an hour, or until it has doubled in size.

Knock the air out of the dough, shape it into a round loaf, and place it on a baking tray. Let
it rise for another thirty minutes while the oven heats to two hundred and twenty degrees. Bake
for thirty to thirty-five minutes; the loaf is done when it sounds hollow when you tap the
bottom.""",
    """Dear Ms Patel, thank you for your letter of the fourteenth about the delayed delivery of your
order. I am sorry that the sofa did not arrive on the date we gave you, and that nobody called
to explain why. Our driver was taken ill on the morning of the delivery, and the message to our
customer team was not passed on.

We have rearranged the delivery for Thursday the twenty-first, between eight in the morning and
one in the afternoon. The driver will call you about thirty minutes before arriving. If that
date does not suit you, please reply to this letter or call our customer team, and we will find
another slot that week.

As an apology for the inconvenience, we have refunded the delivery charge of forty-five pounds
to the card you paid with. You should see it on your statement within five working days. Thank
you for your patience, and please do not hesitate to contact me directly if anything else goes
wrong.""",
))


@dataclass(frozen=True)
class Setting:
    """None: the plain engine (the baseline)."""

    k: int | None = None
    lookup_min: int = 2
    lookup_max: int = 4

    @property
    def label(self) -> str:
        return "baseline" if self.k is None else f"ngram k={self.k}, lookup {self.lookup_min}-{self.lookup_max}"

    def config(self) -> dict | None:
        if self.k is None:
            return None
        return {"method": "ngram", "num_speculative_tokens": self.k,
                "prompt_lookup_min": self.lookup_min, "prompt_lookup_max": self.lookup_max}


@dataclass
class Case:
    """One workload at one batch size: prompts run `batch` at a time."""

    name: str
    prompts: list[list[int]]
    batch: int
    params: list[SamplingParams]  # one per prompt

    @property
    def greedy(self) -> bool:
        return all(p.temperature == 0 for p in self.params)


@dataclass
class Runs:
    """One engine's repeats of one case."""

    seconds: list[float] = field(default_factory=list)  # wall clock, per repeat
    cpu_seconds: list[float] = field(default_factory=list)  # this process's CPU time, per repeat
    output_tokens: int = 0
    tokens: list[list[int]] | None = None  # the first repeat's tokens, per prompt
    repeatable: bool = True  # every repeat gave the first one's tokens
    counters: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))

    def add(self, wall: float, cpu: float, tokens: list[list[int]], counted: dict[str, float]) -> None:
        self.seconds.append(wall)
        self.cpu_seconds.append(cpu)
        if self.tokens is None:
            self.tokens, self.output_tokens = tokens, sum(map(len, tokens))
        self.repeatable &= tokens == self.tokens
        for name in COUNTERS:
            self.counters[name] += counted[name]


COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_disabled", "steps", "step_s",
            "propose_s")


class Timed:
    """Wraps a bound method: calls, and this process's CPU seconds spent in them."""

    def __init__(self, method) -> None:
        self.method, self.calls, self.seconds = method, 0, 0.0

    def __call__(self, *args, **kwargs):
        start = time.process_time()
        try:
            return self.method(*args, **kwargs)
        finally:
            self.seconds += time.process_time() - start
            self.calls += 1


def counters(llm: LLM) -> dict[str, float]:
    core, spec = llm.core, llm.core.speculator
    values = {name: getattr(spec.stats, name) if spec is not None else 0 for name in COUNTERS[:4]}
    return values | {"steps": core.step.calls, "step_s": core.step.seconds,
                     "propose_s": spec.propose.seconds if spec is not None else 0.0}


def measure(engines: dict[Setting, LLM], case: Case, repeats: int) -> dict[Setting, Runs]:
    """Each group of `batch` prompts on every engine in turn, the first engine one further
    along the list each time: the engines share the machine's moments down to one
    generate() call, and none is always first."""
    order, turn = list(engines), 0
    results = {s: Runs() for s in order}
    for r in range(repeats):
        wall, cpu = dict.fromkeys(order, 0.0), dict.fromkeys(order, 0.0)
        tokens: dict[Setting, list[list[int]]] = {s: [] for s in order}
        before = {s: counters(engines[s]) for s in order}
        for i in range(0, len(case.prompts), case.batch):
            for s in order[turn % len(order):] + order[:turn % len(order)]:
                start_wall, start_cpu = time.perf_counter(), time.process_time()
                outputs = engines[s].generate(case.prompts[i:i + case.batch], case.params[i:i + case.batch],
                                              use_tqdm=False)
                wall[s] += time.perf_counter() - start_wall
                cpu[s] += time.process_time() - start_cpu
                tokens[s] += [o.token_ids for o in outputs]
            turn += 1
        for s in order:
            after = counters(engines[s])
            results[s].add(wall[s], cpu[s], tokens[s], {n: after[n] - before[s][n] for n in COUNTERS})
        print(f"  {case.name}, batch {case.batch}, repeat {r + 1}/{repeats}: "
              + ", ".join(f"{s.label} {wall[s]:.2f} s" for s in order), file=sys.stderr, flush=True)
    return results


def summarize(case: Case, results: dict[Setting, Runs]) -> list[dict]:
    base = results[Setting()]
    base_rate = base.output_tokens / statistics.median(base.seconds)
    base_cpu_rate = base.output_tokens / statistics.median(base.cpu_seconds)
    rows = []
    for s, runs in results.items():
        c, n = runs.counters, len(runs.seconds)
        rate = runs.output_tokens / statistics.median(runs.seconds)
        cpu_rate = runs.output_tokens / statistics.median(runs.cpu_seconds)
        rows.append({
            "workload": case.name, "batch": case.batch, "setting": s.label, "speculative_config": s.config(),
            "prompts": len(case.prompts), "output_tokens": runs.output_tokens,
            "seconds": runs.seconds, "median_seconds": statistics.median(runs.seconds),
            "tokens_per_s": rate, "vs_baseline": rate / base_rate,
            # Per second of this process's CPU time: what another process's load on the
            # machine changes least (time it was not scheduled does not count).
            "cpu_seconds": runs.cpu_seconds, "tokens_per_cpu_s": cpu_rate, "vs_baseline_cpu": cpu_rate / base_cpu_rate,
            "acceptance_rate": c["num_accepted_tokens"] / c["num_draft_tokens"] if c["num_draft_tokens"] else None,
            "mean_accepted_length": 1 + c["num_accepted_tokens"] / c["num_drafts"] if c["num_drafts"] else None,
            "requests_disabled": c["num_disabled"] // n,
            "output_tokens_per_step": runs.output_tokens * n / c["steps"],
            "cpu_ms_per_step": c["step_s"] / c["steps"] * 1e3,
            "propose_cpu_ms_per_step": c["propose_s"] / c["steps"] * 1e3,
            # Sampled cases draw different tokens with drafts (rejection sampling uses the
            # random stream differently): only their repeats are compared.
            "tokens_identical": (runs.tokens == base.tokens if case.greedy else None),
            "repeatable": runs.repeatable,
        })
    return rows


def chat_ids(llm: LLM, instruction: str, text: str) -> list[int]:
    # The template holds the BOS token already: encode() must not add another.
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": f"{instruction}\n\n{text}"}],
                                               tokenize=False, add_generation_prompt=True)
    return llm.tokenizer.encode(prompt, add_special_tokens=False)


def build_cases(llm: LLM, args: argparse.Namespace) -> tuple[Case, list[Case]]:
    texts = [t.split("\n\n")[0] for t in TEXTS] if args.quick else list(TEXTS)
    # Text i with instruction i first: a short batch-1 run still sees every instruction.
    pairs = [(INSTRUCTIONS[(t + i) % 4], texts[t]) for i in range(4) for t in range(4)]
    repetitive = [chat_ids(llm, instruction, text) for instruction, text in pairs]
    rng = random.Random(0)
    words = sorted({w.strip(".,;") for t in TEXTS for w in t.split()})
    noise = [chat_ids(llm, "Answer these words:", " ".join(rng.choice(words) for _ in range(args.random_words)))
             for _ in range(len(repetitive))]
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    # Random prompts get their full max_tokens (ignore_eos): every engine decodes as many.
    noisy = [SamplingParams(max_tokens=args.max_tokens, temperature=args.random_temperature, seed=i,
                            ignore_eos=True) for i in range(len(noise))]
    big, small = args.batch, args.batch1_prompts
    sweep = Case("repetitive", repetitive[:small], 1, [greedy] * small)
    return sweep, [Case("repetitive", repetitive[:big], big, [greedy] * big),
                   Case("random", noise[:small], 1, noisy[:small]), Case("random", noise[:big], big, noisy[:big])]


def make_engine(args: argparse.Namespace, setting: Setting) -> LLM:
    spec = setting.config()
    if spec is not None:
        spec.update(min_acceptance_rate=args.min_acceptance_rate, acceptance_window=args.acceptance_window)
    llm = LLM(args.model, dtype="float32", num_threads=args.threads, max_num_seqs=args.batch,
              kv_cache_memory_gib=args.kv_gib, enable_prefix_caching=False, speculative_config=spec)
    llm.core.step = Timed(llm.core.step)  # LLM.generate calls it through the instance
    if llm.core.speculator is not None:
        llm.core.speculator.propose = Timed(llm.core.speculator.propose)
    return llm


def table(rows: list[dict]) -> str:
    lines = ["| workload | batch | setting | output tokens | median s | tokens/s | vs baseline "
             "| vs baseline, CPU time | acceptance | mean accepted length | requests disabled | tokens / step "
             "| CPU ms / step | propose CPU ms / step | tokens identical |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    same = {True: "yes", False: "NO", None: "(sampled)"}
    for r in rows:
        acc = "" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        length = "" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        lines.append(f"| {r['workload']} | {r['batch']} | {r['setting']} | {r['output_tokens']} | "
                     f"{r['median_seconds']:.2f} | {r['tokens_per_s']:.1f} | {r['vs_baseline']:.2f}x | "
                     f"{r['vs_baseline_cpu']:.2f}x | {acc} | "
                     f"{length} | {r['requests_disabled']} | {r['output_tokens_per_step']:.2f} | "
                     f"{r['cpu_ms_per_step']:.1f} | {r['propose_cpu_ms_per_step']:.2f} | "
                     f"{same[r['tokens_identical']]} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEMO_MODEL)
    p.add_argument("--ks", default="2,3,4,5", help="num_speculative_tokens to sweep (default lookup)")
    p.add_argument("--lookups", default="1-4,3-5", help="prompt_lookup_min-max settings also swept, at --lookup-k")
    p.add_argument("--lookup-k", type=int, default=4)
    p.add_argument("--min-acceptance-rate", type=float, default=0.1)
    p.add_argument("--acceptance-window", type=int, default=32)
    p.add_argument("--batch", type=int, default=16, help="the large batch (at most 16 prompts)")
    p.add_argument("--batch1-prompts", type=int, default=4, help="prompts run one at a time at batch 1")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--random-words", type=int, default=120)
    p.add_argument("--random-temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-gib", type=float, default=1.0)
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: first paragraphs only, k 2 and 4, 2 prompts, 24 tokens, batch 2, 1 repeat")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.ks, args.lookups, args.batch, args.batch1_prompts = "2,4", "1-4", 2, 2
        args.max_tokens, args.random_words, args.repeats, args.kv_gib = 24, 40, 1, 0.25
    if not 1 <= args.batch <= 16 or not 1 <= args.batch1_prompts <= 16:
        p.error(f"--batch and --batch1-prompts must be in [1, 16] (4 texts x 4 instructions), "
                f"got {args.batch} and {args.batch1_prompts}")
    return args


def sweep_settings(args: argparse.Namespace) -> list[Setting]:
    settings = [Setting(int(k)) for k in args.ks.split(",")]
    for lookup in filter(None, args.lookups.split(",")):
        low, high = map(int, lookup.split("-"))
        settings.append(Setting(args.lookup_k, low, high))
    return list(dict.fromkeys(settings))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    started = {"loadavg": os.getloadavg(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    engines = {Setting(): make_engine(args, Setting())}
    sweep_case, cases = build_cases(engines[Setting()], args)
    for s in sweep_settings(args):
        engines[s] = make_engine(args, s)
    for llm in engines.values():  # warm-up: first calls allocate and load kernels
        llm.generate(sweep_case.prompts[:1], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    sweep = summarize(sweep_case, measure(engines, sweep_case, args.repeats))
    best_row = max(sweep[1:], key=lambda r: r["tokens_per_s"])
    best = next(s for s in engines if s.label == best_row["setting"])
    for s in [s for s in engines if s not in (Setting(), best)]:
        del engines[s]  # free their memory before the batch runs
    rows = [r for r in sweep if r["setting"] in ("baseline", best.label)]
    for case in cases:
        rows += summarize(case, measure(engines, case, args.repeats))
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpus": os.cpu_count(), "threads": args.threads, "processor": _processor(),
                    "python": platform.python_version(), "torch": _torch_version()},
        "started": started, "finished": {"loadavg": os.getloadavg(), "time": time.strftime("%Y-%m-%d %H:%M:%S")},
        "settings": {k: v for k, v in vars(args).items() if k != "json"} | {"model": args.model},
        "best": best.label, "sweep": sweep, "cases": rows,
        # Every greedy case's tokens equal the baseline's, and every engine repeats its own.
        "tokens_identical": all(r["tokens_identical"] is not False and r["repeatable"] for r in sweep + rows),
    }
    print(f"\nsweep: repetitive, batch 1 ({args.repeats} repeats, {args.threads} thread(s))\n")
    print(table(sweep))
    print(f"\nbest setting ({best.label}) against the baseline\n")
    print(table(rows))
    print(f"\ngreedy tokens identical in every case: {'yes' if report['tokens_identical'] else 'NO'}; "
          f"load average {started['loadavg'][0]:.2f} at the start, {report['finished']['loadavg'][0]:.2f} at the end")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return report


def _processor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    main()
