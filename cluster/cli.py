"""The `pdserve` command: model preparation, offline generation, and serving."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# The API key a CLI call to a router sends (`Authorization: Bearer`), unless --api-key.
API_KEY_ENV = "PDSERVE_API_KEY"
# The admin key `pdserve scale` sends to a router's /admin/ endpoints, unless --admin-key.
ADMIN_KEY_ENV = "PDSERVE_ADMIN_KEY"


def _cmd_model_prepare(args: argparse.Namespace) -> int:
    from cluster.demo_model import prepare_demo_model

    path = prepare_demo_model(args.name, Path(args.models_dir) if args.models_dir else None, args.force)
    print(path)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": c}] for c in args.chat], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for out in outputs:
        print(out.text)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import dataclasses

    from cluster import console
    from cluster.config import load_cluster_config
    from cluster.launcher import launcher_for
    from cluster.serve import serve

    console.configure()  # each worker's start and every request, as they happen (stderr)
    config = load_cluster_config(args.config)
    if args.port is not None:
        config = dataclasses.replace(config, router=dataclasses.replace(config.router, port=args.port))
    if args.model is not None:  # e.g. under `ray job submit`, whose upload leaves out models/
        config = dataclasses.replace(config, model=args.model)
    if args.ray:
        config = dataclasses.replace(config, launcher="ray")
    launcher_for(config).check(config)  # here, before any worker starts and fails on a missing model
    serve(config, detach=args.detach)
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    from cluster.config import load_cluster_config
    from cluster.launcher import launcher_for

    config = load_cluster_config(args.config)
    launcher = launcher_for(config)
    if not launcher.detachable:
        raise ValueError(f"{args.config}: only a Ray deployment (launcher: ray) runs detached; "
                         "a local one stops with its `pdserve serve` (Ctrl-C)")
    try:
        url = launcher.down(config)
    except LookupError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 1
    print(f"pdserve: stopped the deployment {config.ray.name!r} that served {url}")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    import os

    from cluster.status import fetch_status, format_status

    url, key = args.url, args.api_key or os.environ.get(API_KEY_ENV)
    if url is None:
        from cluster.config import load_cluster_config

        router = load_cluster_config(args.config).router
        url = f"http://{router.host}:{router.port}"
        key = key or (router.api_keys or (None,))[0]  # the operator's own config: its first key
    try:
        print(format_status(fetch_status(url, api_key=key)))
    except (ConnectionError, PermissionError, ValueError) as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _cmd_scale(args: argparse.Namespace) -> int:
    """Scale a running deployment (or, with neither --prefill nor --decode, show its
    pools): through its router's admin endpoint (--url, or a config of launcher local),
    or, for a Ray deployment (a config of launcher ray, or its name), through Ray."""
    import os

    from cluster.admin_client import admin_request, describe

    targets = {k: v for k, v in (("prefill", args.prefill), ("decode", args.decode)) if v is not None}
    key = args.admin_key or os.environ.get(ADMIN_KEY_ENV)
    url, ray_name, ray_address = args.url, None, args.ray_address
    if args.target is None and url is None:
        raise ValueError("name the deployment: its cluster config, its Ray name, or --url")
    if args.target is not None and Path(args.target).is_file():
        from cluster.config import load_cluster_config

        config = load_cluster_config(args.target)
        if config.launcher == "ray" and url is None:
            ray_name, ray_address = config.ray.name, ray_address or config.ray.address
        elif config.launcher != "ray":
            url = url or f"http://{config.router.host}:{config.router.port}"
            key = key or (config.router.admin_keys or (None,))[0]  # the operator's own config: its first key
    elif args.target is not None:
        if Path(args.target).suffix in (".yaml", ".yml") or "/" in args.target:
            raise FileNotFoundError(f"no config file {args.target!r} (a Ray deployment's name has no '/' "
                                    "or .yaml)")
        if url is not None:
            raise ValueError(f"--url names a router; {args.target!r} names a Ray deployment: give one of them")
        ray_name = args.target  # not a file: a Ray deployment's name
    try:
        if ray_name is not None:
            from cluster.ray.scale import scale_on_ray

            result = scale_on_ray(ray_name, ray_address or "auto", targets.get("prefill"), targets.get("decode"))
        elif targets:
            result = admin_request(url, "POST", "/admin/scale", key, targets)
        else:
            result = admin_request(url, "GET", "/admin/pools", key, timeout=30)
    # ScaleFailed (a worker did not start) is a RuntimeError; a bound refused is a
    # ValueError, which main() reports with exit status 2.
    except (ConnectionError, PermissionError, LookupError, RuntimeError, TimeoutError) as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 1
    print(f"pdserve: {describe(result)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="manage local model directories")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    prepare = model_sub.add_parser("prepare", help="build a demo model directory offline (once)")
    prepare.add_argument("name", nargs="?", default="smollm2", help="smollm2 (the dense demo) or deepseek-mini (MoE + MLA, generated weights)")
    prepare.add_argument("--models-dir", default=None, help="default: $PDSERVE_MODELS_DIR or ./models")
    prepare.add_argument("--force", action="store_true", help="rebuild even if present")
    prepare.set_defaults(func=_cmd_model_prepare)

    gen = sub.add_parser("generate", help="offline generation with the colocated engine")
    gen.add_argument("--model", required=True, help="Hugging Face model directory")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", action="append", help="raw prompt (repeatable)")
    source.add_argument("--chat", action="append", help="user message, sent through the chat template (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", default="float32")
    gen.add_argument("--device", default="cpu")
    gen.set_defaults(func=_cmd_generate)

    serve = sub.add_parser("serve", help="serve a cluster config: workers (local processes or Ray actors) + the router")
    serve.add_argument("config", help="YAML cluster config, e.g. configs/local.yaml")
    serve.add_argument("--port", type=int, default=None, help="override router.port")
    serve.add_argument("--model", default=None, help="override model (a directory every worker's node can read)")
    serve.add_argument("--ray", action="store_true", help="place the workers with Ray (launcher: ray), "
                       "with the config's ray section or its defaults (a private local Ray)")
    serve.add_argument("--detach", action="store_true",
                       help="Ray only: leave the deployment running on the cluster and return; `pdserve down` stops it")
    serve.set_defaults(func=_cmd_serve)

    down = sub.add_parser("down", help="stop a detached Ray deployment (pdserve serve --detach)")
    down.add_argument("config", help="its cluster config (Ray address and ray.name)")
    down.set_defaults(func=_cmd_down)

    scale = sub.add_parser("scale", help="add or remove workers of a running deployment (drains those removed)")
    scale.add_argument("target", nargs="?", default=None, help="its cluster config, or the name of a Ray "
                       "deployment (ray.name); with --url, a config only lends its admin key")
    scale.add_argument("--prefill", type=int, default=None, help="the prefill pool's new number of workers")
    scale.add_argument("--decode", type=int, default=None, help="the decode pool's new number of workers (>= 1)")
    scale.add_argument("--url", default=None, help="the router's base URL (its admin endpoint), e.g. "
                       "http://127.0.0.1:8000")
    scale.add_argument("--admin-key", default=None, help=f"the admin key (default: ${ADMIN_KEY_ENV}; with a config "
                       "and neither, its first router.admin_keys)")
    scale.add_argument("--ray-address", default=None, help="the Ray cluster of a deployment named by NAME "
                       "(default: auto, or the config's ray.address)")
    scale.set_defaults(func=_cmd_scale)

    status = sub.add_parser("status", help="a running deployment's decode workers: health, queues, KV usage")
    where = status.add_mutually_exclusive_group()
    where.add_argument("config", nargs="?", default="configs/local.yaml", help="its cluster config (router address)")
    where.add_argument("--url", default=None, help="the router's base URL, e.g. http://127.0.0.1:8000")
    status.add_argument("--api-key", default=None, help=f"the API key to send (default: ${API_KEY_ENV}, which, unlike "
                        "a flag, other users' `ps` does not show; with a config and neither, its first router.api_keys)")
    status.set_defaults(func=_cmd_status)
    return parser


def main(argv: list[str] | None = None) -> int:
    from cluster.ray.resources import PlacementError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, PlacementError) as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
