"""Resident memory of a router process: import router.app, build a Router and its app
on a model, and report the process's RSS (VmRSS now, ru_maxrss peak) and whether torch
was imported. Each run is a fresh Python process; the median of --runs is printed.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.serving router_memory --runs 5
    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.serving router_memory --model models/SmolLM2-135M-Instruct --json out.json

The Router is built as the launcher builds it (cluster/serve.py), with one decode
worker address nobody listens on: no worker and no socket traffic is involved. Run it
from the root of the tree to measure; on a tree from before the router took a
RouterConfig and ModelLimits (commit 0e80d69 and earlier), it builds the Router from a
ClusterConfig as that tree did.

With --serve CONFIG it measures the real thing instead: the `pdserve serve` process
(the launcher, where the router runs; its workers are other processes) once it serves
and has answered one completion, then stops it with SIGINT:

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.serving router_memory --serve configs/local.yaml --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
start = time.perf_counter()
import router.app
try:
    from router.config import ModelLimits
except ImportError:  # a tree where the Router takes the whole ClusterConfig
    ModelLimits = None
from engine.config import EngineConfig
model, address = sys.argv[1], "tcp://127.0.0.1:9"
if ModelLimits is None:
    from cluster.config import ClusterConfig
    config = ClusterConfig.from_dict({"model": model, "prefill": {"replicas": 0}})
    r = router.app.Router(config, {"decode-0": address})
else:
    from cluster.config import RouterConfig  # only its defaults; the Router does not import cluster/
    r = router.app.Router(RouterConfig(), ModelLimits.of(EngineConfig(model=model)), {"decode-0": address})
app = router.app.create_app(r)
seconds = time.perf_counter() - start
rss_kib = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:"))
print(json.dumps({"rss_mib": rss_kib / 1024, "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "seconds": seconds, "torch": "torch" in sys.modules}))
"""


def one_run(model: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, model], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"the router process failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def one_serve(config: str, port: int, timeout: float = 300.0) -> dict:
    """VmRSS of a `pdserve serve` process serving one completion (its workers are not counted)."""
    import http.client
    import os
    import signal
    import time

    cmd = [sys.executable, "-c", "import sys; from cluster.cli import main; sys.exit(main())", "serve", config,
           "--port", str(port)]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": os.getcwd()}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        start = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"pdserve serve exited:\n{proc.stderr.read()}")
            if time.monotonic() > start + timeout:
                raise RuntimeError(f"pdserve serve did not serve within {timeout:g} s")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                conn.request("POST", "/v1/completions", json.dumps({"prompt": "Hello", "max_tokens": 8}),
                             {"Content-Type": "application/json"})
                if conn.getresponse().status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        seconds = time.monotonic() - start
        status = dict(line.split(":", 1) for line in open(f"/proc/{proc.pid}/status").read().splitlines())
        torch = any("torch/lib" in line for line in open(f"/proc/{proc.pid}/maps"))
        return {"rss_mib": int(status["VmRSS"].split()[0]) / 1024, "maxrss_mib": int(status["VmHWM"].split()[0]) / 1024,
                "seconds": seconds, "torch": torch}
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--serve", metavar="CONFIG", default=None, help="measure `pdserve serve CONFIG` instead")
    p.add_argument("--port", type=int, default=8391)
    args = p.parse_args()
    if args.serve:
        runs = [one_serve(args.serve, args.port) for _ in range(args.runs)]
    else:
        runs = [one_run(args.model) for _ in range(args.runs)]
    summary = {key: statistics.median(r[key] for r in runs) for key in ("rss_mib", "maxrss_mib", "seconds")}
    summary["torch_loaded"] = any(r["torch"] for r in runs)
    print(f"median of {args.runs}: VmRSS {summary['rss_mib']:.0f} MiB, ru_maxrss {summary['maxrss_mib']:.0f} MiB, "
          f"{'start to a first completion' if args.serve else 'import + build'} {summary['seconds']:.2f} s, "
          f"torch loaded: {summary['torch_loaded']}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"runs": runs, "median": summary}, f, indent=1)


if __name__ == "__main__":
    main()
