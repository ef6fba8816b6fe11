"""What benchmarks/serving/serve_compare.py accepts: a file that is a benchmarks/serving/serve.py --json
report, and two of them made by one command (the same requests: same lengths, seeds,
load points), whatever server each ran against. A ratio of two different workloads
says nothing about disaggregation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# serve.py's arguments that are not the workload (where it ran, where it wrote, the SLOs
# only goodput uses) are left out; so are lengths a workload does not use (prompt_len
# with prompt_tokens, token_ids without, duration with a request count).
_RESULT_KEYS = ("ok", "ttft", "e2e", "output_tokens")
_RUN_KEYS = ("seed", "load", "results", "request_throughput")


def _shape_problem(report: Any) -> str | None:
    if not isinstance(report, dict):
        return f"it holds a JSON {type(report).__name__}, not an object"
    if not isinstance(report.get("args"), dict):
        return "it has no 'args' object (the command's arguments)"
    runs = report.get("runs")
    if not isinstance(runs, list) or not runs:
        return "it has no 'runs' list (serve.py writes one since it runs several seeds)"
    for i, run in enumerate(runs):
        missing = [k for k in _RUN_KEYS if not isinstance(run, dict) or k not in run]
        if missing:
            return f"runs[{i}] has no {', '.join(map(repr, missing))}"
        point = {"poisson": "rate", "concurrency": "concurrency"}.get(run["load"])
        if point is None or point not in run:
            return f"runs[{i}] has load {run['load']!r} without its rate or concurrency"
        if not isinstance(run["results"], list):
            return f"runs[{i}].results is not a list"
        for j, result in enumerate(run["results"]):
            missing = [k for k in _RESULT_KEYS if not isinstance(result, dict) or k not in result]
            if missing:
                return f"runs[{i}].results[{j}] has no {', '.join(map(repr, missing))}"
    return None


def load_report(path: str | Path) -> dict[str, Any]:
    """The serve.py --json report in the file at path; ValueError naming the file and
    what is wrong (missing, unreadable, not JSON, not serve.py's)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a text file, so not a benchmarks/serving/serve.py --json report") from None
    try:
        report = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON ({exc})") from None
    problem = _shape_problem(report)
    if problem:
        raise ValueError(f"{path} is not a benchmarks/serving/serve.py --json report: {problem}")
    return report


def _numbers(text: Any, kind: type) -> Any:
    """"0.5,1" -> [0.5, 1.0], so that "1" and "1.0" are one rate; anything else as it is."""
    if not isinstance(text, str):
        return text
    try:
        return [kind(item) for item in text.split(",")]
    except ValueError:
        return text


def workload(args: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a serve.py command that decide its requests, by option name."""
    seeds = args["seeds"] if "seeds" in args else [args.get("seed")]
    out = {"--seeds": sorted(seeds) if isinstance(seeds, list) else seeds,
           "--rates": _numbers(args.get("rates"), float), "--concurrency": _numbers(args.get("concurrency"), int),
           "--num-requests": args.get("num_requests"), "--output-len": args.get("output_len"),
           "--prompt-tokens": args.get("prompt_tokens"), "--shared-prefix": args.get("shared_prefix")}
    if args.get("prompt_tokens") is None:
        out["--prompt-len"] = args.get("prompt_len")
    else:
        out["--token-ids"] = args.get("token_ids")
    if args.get("num_requests") is None and args.get("rates"):
        out["--duration"] = args.get("duration")
    return out


def check_same_command(disagg: dict[str, Any], coloc: dict[str, Any]) -> None:
    """ValueError listing every workload argument in which the two reports' commands
    differ. Reports without 'args' (built in code, not read from files) are not checked."""
    if "args" not in disagg and "args" not in coloc:
        return
    if "args" not in disagg or "args" not in coloc:
        raise ValueError("only one of the two reports records its command's arguments")
    d, c = workload(disagg["args"]), workload(coloc["args"])
    diffs = [f"{option} {d.get(option)} vs {c.get(option)}" for option in dict.fromkeys([*d, *c])
             if d.get(option) != c.get(option)]
    if diffs:
        raise ValueError("the two files come from different serve.py commands, so their requests differ "
                         f"(disaggregated vs colocated): {'; '.join(diffs)}")
