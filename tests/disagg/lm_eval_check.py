"""lm-evaluation-harness against pdserve: the local multiple-choice task
(tests/data/mc_task.yaml) with lm-eval's `local-completions` model on a pdserve server
and with its `hf` model on the same checkpoint; the accuracies must be equal and every
per-item loglikelihood within --tolerance.

Needs `pip install lm_eval==0.4.13` (not a project requirement: too heavy for `make
test`, whose tests/disagg/test_prompt_logprobs_serving.py scores the same task the same
way without it). Nothing is downloaded: the task's data is a local JSON file.

    .venv/bin/python tests/disagg/lm_eval_check.py                  # starts a server (demo model)
    .venv/bin/python tests/disagg/lm_eval_check.py --url http://127.0.0.1:8000   # a running `pdserve serve`
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
TASK = "pdserve_mc"


def evaluate(model: str, model_args: dict[str, Any]) -> tuple[float, list[list[float]]]:
    """(accuracy, per document the loglikelihood of each choice) of one lm-eval run."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], batch_size=1,
                                  task_manager=TaskManager(include_path=str(ROOT / "tests" / "data")),
                                  log_samples=True)
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    # resps: per choice [[loglikelihood, is_greedy]]
    return out["results"][TASK]["acc,none"], [[float(r[0][0]) for r in s["resps"]] for s in samples]


def start_server(model: Path) -> tuple[Any, str]:
    """A colocated deployment (one decode worker) of `model` in float32; (workers, URL)."""
    from cluster.config import ClusterConfig
    from cluster.serve import HTTPServer, build

    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = ClusterConfig.from_dict({"model": str(model), "dtype": "float32", "prefill": {"replicas": 0},
                                      "router": {"port": port, "access_log": False}})
    workers, router = build(config)
    http = HTTPServer(router, "127.0.0.1", config.router.port, 60.0)
    return (workers, http), http.url


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="the checkpoint (both runs)")
    parser.add_argument("--url", help="a running pdserve router serving --model (default: start one)")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--out", type=Path, help="write the comparison as JSON here")
    args = parser.parse_args()
    os.chdir(ROOT)  # the task's data_files path is relative to the repository root
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    server, url = (None, args.url) if args.url else start_server(args.model)
    try:
        start = time.monotonic()
        served_acc, served = evaluate("local-completions", {
            "model": str(args.model), "base_url": f"{url.rstrip('/')}/v1/completions",
            "tokenizer": str(args.model), "tokenizer_backend": "huggingface", "tokenized_requests": True,
            "num_concurrent": 1, "max_retries": 1})
        served_s = time.monotonic() - start
    finally:
        if server is not None:
            server[1].stop()
            server[0].stop()
    start = time.monotonic()
    hf_acc, hf = evaluate("hf", {"pretrained": str(args.model), "dtype": "float32", "device": "cpu"})
    hf_s = time.monotonic() - start
    diffs = [abs(a - b) for doc_a, doc_b in zip(served, hf) for a, b in zip(doc_a, doc_b)]
    ok = served_acc == hf_acc and len(served) == len(hf) and max(diffs) <= args.tolerance
    report = {"task": TASK, "documents": len(hf), "items": len(diffs), "accuracy_pdserve": served_acc,
              "accuracy_hf": hf_acc, "max_abs_loglikelihood_diff": max(diffs), "tolerance": args.tolerance,
              "seconds_pdserve": round(served_s, 1), "seconds_hf": round(hf_s, 1), "ok": ok}
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
