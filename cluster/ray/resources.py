"""What a cluster config asks of Ray, and what a Ray cluster lacks to give it.

Pure functions over plain dicts (no Ray import), so the launcher can refuse an
impossible config in milliseconds, naming what is missing, instead of leaving
placement groups pending forever; and so tests need no cluster.
"""

from __future__ import annotations

from cluster.config import ClusterConfig

Resources = dict[str, float]  # Ray resource name -> amount ("CPU", "GPU", custom names)


class PlacementError(RuntimeError):
    """The Ray cluster cannot (or did not in time) give the config its resources."""


def tp_size(config: ClusterConfig, role: str) -> int:
    return config.engine_config(role).tensor_parallel_size


def rank_bundles(config: ClusterConfig, role: str) -> list[Resources]:
    """One worker's placement-group bundles: one per tensor-parallel rank, each the
    pool's `ray.<pool>` shape (packed on one node: STRICT_PACK)."""
    return [getattr(config.ray, role).bundle() for _ in range(tp_size(config, role))]


def pool_bundles(config: ClusterConfig) -> dict[str, list[Resources]]:
    """Role -> what each worker needs on one node: the sum of its ranks' bundles (pools
    with no workers are left out)."""
    out = {}
    for role in ("decode", "prefill"):
        replicas = getattr(config, role).replicas
        if replicas:
            ranks = rank_bundles(config, role)
            worker = {k: sum(b[k] for b in ranks) for k in ranks[0]}
            out[role] = [dict(worker) for _ in range(replicas)]
    return out


def fmt_resources(resources: Resources) -> str:
    """{CPU: 1, GPU: 0.5}: as error messages name resources."""
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


def missing_resources(bundles: dict[str, list[Resources]], nodes: list[Resources]) -> list[str]:
    """Why `nodes` (each alive node's total resources) can never hold `bundles`; empty
    if they might. Checks each worker's shape against single nodes (a bundle never spans
    nodes) and the sum of all pools against the cluster's totals. Resources held by
    others are not seen here: the launcher's placement timeout catches those."""
    problems = []
    for role, role_bundles in bundles.items():
        shape = role_bundles[0]
        if not any(all(node.get(k, 0.0) >= v for k, v in shape.items()) for node in nodes):
            short = [f"{k} {v:g} (largest node has {max((n.get(k, 0.0) for n in nodes), default=0.0):g})"
                     for k, v in sorted(shape.items())
                     if not any(n.get(k, 0.0) >= v for n in nodes)]
            problems.append(f"{role}: each worker needs {fmt_resources(shape)} on one node; "
                            f"missing: {', '.join(short) or 'no single node has all of it'}")
    need: Resources = {}
    for role_bundles in bundles.values():
        for bundle in role_bundles:
            for k, v in bundle.items():
                need[k] = need.get(k, 0.0) + v
    have = {k: sum(n.get(k, 0.0) for n in nodes) for k in need}
    over = {k: v for k, v in need.items() if v > have[k]}
    if over:
        problems.append(f"all pools together need {fmt_resources(over)}, "
                        f"the cluster has {fmt_resources({k: have[k] for k in over})}")
    return problems


# Transports that move KV through memory of one host (/dev/shm files, CUDA IPC handles).
ONE_HOST_TRANSPORTS = ("shm", "cuda_ipc")


def check_one_host_transport(transport: str, nodes: dict[str, list[str]]) -> None:
    """Refuse a one-host transport when Ray placed the pools on several nodes: a prefill
    worker could not reach a decode worker's cache (every prompt would fall back to a
    local prefill). `nodes`: role -> the node id of each of its workers."""
    if transport not in ONE_HOST_TRANSPORTS or not nodes.get("prefill"):
        return
    placed = sorted({node for role_nodes in nodes.values() for node in role_nodes})
    if len(placed) > 1:
        raise PlacementError(
            f"transport: {transport} moves KV within one host, but Ray placed the pools on {len(placed)} nodes "
            f"({', '.join(n[:12] for n in placed)}): use transport tcp, nixl or nccl between hosts, or pin both "
            f"pools to one node (ray.prefill.resources / ray.decode.resources)")
