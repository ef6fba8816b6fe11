"""The roofline report's command line (`python -m benchmarks.offline roofline`): measure
steps against their floors, print the table, write JSON and plots; or plot serve.py
reports' latency CDFs."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BLOCK_SIZE = 16  # the engine's default block size: a prefix-cache hit is whole blocks


def _ints(text: str, minimum: int, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < minimum:
        raise argparse.ArgumentTypeError(f"{what} must be integers >= {minimum}, got {text!r}")
    return sorted(set(values))


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def run_parser() -> argparse.ArgumentParser:
    from cluster.demo_model import DEMO_MODELS, default_models_dir

    p = argparse.ArgumentParser(prog="roofline.py", description="Engine step times against their roofline "
                                "floors (subcommand `cdf`: TTFT/TPOT CDFs of serve.py reports).")
    p.add_argument("--model", default=str(default_models_dir() / DEMO_MODELS["smollm2"].dir_name),
                   help="model directory (default: the demo model)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--load-format", choices=("safetensors", "dummy"), default="safetensors",
                   help="dummy: weights generated on the device (a model dir with only config.json)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--roof", choices=("measured", "h200"), default=None,
                   help="measured (the device's torch.mm rate and copy bandwidth) or the H200's datasheet "
                        "roofs; default: measured on CPU, h200 on CUDA")
    p.add_argument("--batches", type=lambda t: _ints(t, 1, "--batches"), default=[1, 4, 16],
                   help="decode batch sizes, comma-separated")
    p.add_argument("--contexts", type=lambda t: _ints(t, 1, "--contexts"), default=[128, 512],
                   help="decode contexts (prompt tokens per sequence), comma-separated")
    p.add_argument("--steps", type=_positive, default=4, help="decode steps per timed window")
    p.add_argument("--windows", type=_positive, default=3, help="timed windows per point (the median is kept)")
    p.add_argument("--prefill-chunk", type=_positive, default=256, help="new tokens of the timed prefill step")
    p.add_argument("--prefill-context", type=int, default=256,
                   help=f"cached tokens before that chunk (a multiple of {BLOCK_SIZE})")
    p.add_argument("--threads", type=_positive, default=None,
                   help="CPU: torch threads for the roofs and the engine (default: torch's); 1 keeps a "
                        "shared machine's figures steadier")
    p.add_argument("--analytic-only", action="store_true", help="print the floors; run no engine")
    p.add_argument("--from-json", default=None, help="a report written by --json: print and plot it again")
    p.add_argument("--json", dest="json_path", default=None, help="write the report here")
    p.add_argument("--plots", default=None, help="write roofline-<device>.png and decode-steps-<device>.png here")
    return p


def cdf_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="roofline.py cdf",
                                description="TTFT and TPOT CDFs from benchmarks/serving/serve.py --json reports")
    p.add_argument("--json", nargs="+", required=True, help="two or more serve.py --json reports")
    p.add_argument("--labels", required=True, help="comma-separated, one per report")
    p.add_argument("--out", required=True, help="PNG path")
    p.add_argument("--title", default="")
    p.add_argument("--point", default=None,
                   help='only the runs at this load point, e.g. "rate 0.3/s" or "concurrency 1" (default: all)')
    return p


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["cdf"]:
        cdf_main(argv[1:])
    else:
        run_main(argv)


def cdf_main(argv: list[str]) -> None:
    from benchmarks.offline.roofline.plots import plot_serve_cdfs

    p = cdf_parser()
    args = p.parse_args(argv)
    labels = [x.strip() for x in args.labels.split(",")]
    if len(args.json) < 2:
        p.error(f"--json needs two or more serve reports to compare, got {len(args.json)}")
    if len(labels) != len(args.json):
        p.error(f"--labels names {len(labels)} reports but --json gives {len(args.json)}")
    reports = []
    for path in args.json:
        try:
            reports.append(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            p.error(f"cannot read serve report {path}: {exc}")
    try:
        out = plot_serve_cdfs(reports, labels, args.out, args.title, args.point)
    except (ValueError, KeyError, TypeError) as exc:
        p.error(f"cannot plot these serve.py --json reports: {exc}")
    print(f"wrote {out}")


def run_main(argv: list[str]) -> None:
    p = run_parser()
    args = p.parse_args(argv)
    if args.from_json:
        try:
            report = json.loads(Path(args.from_json).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            p.error(f"cannot read report {args.from_json}: {exc}")
    else:
        report = _build_report(p, args)
    print(format_run(report))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(report, indent=1))
    if args.plots:
        from benchmarks.offline.roofline.plots import plot_roofline, plot_step_times

        device = report["device"].split(":")[0]
        for path in (plot_roofline(report, Path(args.plots) / f"roofline-{device}.png"),
                     plot_step_times(report, Path(args.plots) / f"decode-steps-{device}.png")):
            print(f"wrote {path}")


def format_run(report: dict[str, Any]) -> str:
    from benchmarks.offline.roofline.report import format_table

    roof = report["roof"]
    head = (f"{report['model']}, {report['dtype']} on {report['device']}; roofs: {roof['name']}"
            + (f"\n{report['note']}" if report.get("note") else ""))
    return f"{head}\n\n{format_table(report)}"


def _build_report(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.offline.roofline import report as rep
    from benchmarks.offline.roofline.analytic import ModelShape, dtype_bytes
    from benchmarks.offline.roofline.roofs import H200, measured_roof

    if args.device != "cpu" and not args.device.startswith("cuda"):
        p.error(f"--device must be cpu or cuda[:N], got {args.device!r}")
    if args.prefill_context < 0 or args.prefill_context % BLOCK_SIZE:
        p.error(f"--prefill-context must be a multiple of {BLOCK_SIZE} (a prefix-cache hit is whole blocks), "
                f"got {args.prefill_context}")
    try:
        shape = ModelShape.from_model_dir(args.model)
    except (OSError, ValueError, KeyError) as exc:
        p.error(f"--model {args.model}: {exc}")
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    roof_kind = args.roof or ("measured" if args.device == "cpu" else "h200")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)  # the roofs are measured on the threads the engine gets
    roof = H200 if roof_kind == "h200" else measured_roof(args.device, dtype)
    width = dtype_bytes(dtype)
    if args.analytic_only:
        rows = rep.analytic_rows(shape, width, roof, args.batches, args.contexts, args.prefill_chunk,
                                 args.prefill_context)
        return rep.make_report(args.model, args.device, dtype, shape, roof, rows, "analytic floors only")
    measured = _measure(args, shape, dtype, width)
    threads = f", {args.threads} thread(s)" if args.threads else ""
    note = (f"medians over {args.windows} windows of {args.steps} decode steps "
            f"(prefill: {args.windows} steps), after a settling step{threads}")
    return rep.make_report(args.model, args.device, dtype, shape, roof, rep.measured_rows(shape, width, roof, measured),
                           note)


def _measure(args: argparse.Namespace, shape, dtype: str, width: int) -> list:
    from benchmarks.offline.roofline.measure import decode_steps, make_engine, prefill_steps

    kv_per_token = shape.layers * 2 * shape.kv_heads * shape.head_dim * width
    longest = max(max(args.contexts) + args.steps * args.windows + 2, args.prefill_context + args.prefill_chunk)
    # Room for the largest batch (and the prefill's prefix and chunks), rounded up to blocks.
    tokens = (max(args.batches) + 4) * (longest + 2 * BLOCK_SIZE)
    kv_gib = max(0.05, 1.25 * tokens * kv_per_token / 2**30)
    llm = make_engine(args.model, args.device, dtype, max(args.batches), max(512, args.prefill_chunk), kv_gib,
                      args.threads, args.load_format)
    core = llm.core
    start = time.perf_counter()

    def progress(m) -> None:
        print(f"[{time.perf_counter() - start:5.0f} s] {m.kind} batch {m.batch} context {m.context}: "
              f"{m.seconds * 1e3:.2f} ms", file=sys.stderr, flush=True)

    measured = decode_steps(core, args.device, args.batches, args.contexts, shape.vocab, args.steps, args.windows,
                            progress)
    measured.append(prefill_steps(core, args.device, args.prefill_chunk, args.prefill_context, shape.vocab,
                                  args.windows))
    return measured
