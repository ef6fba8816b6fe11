"""`pdserve scale NAME --prefill N --decode M` for a deployment on Ray: find its
DeploymentActor (named NAME in namespace "pdserve": detached, or held by a running
`pdserve serve` or Ray job) and have it scale its pools (cluster/elastic.py's
PoolScaler, through DeploymentActor.scale), or, with neither pool given, say what
they are. Only the request and its answer travel through Ray; the actor drains and
starts workers itself, so the command may be interrupted without harm to the scale it
asked for.
"""

from __future__ import annotations

import os
from typing import Any

import ray

from cluster.ray.deployment import NAMESPACE, unwrap
from cluster.ray.workers import probe_address

# Starting workers (each within ray.placement_timeout_s plus its model load) and
# draining others (drain_timeout_s): far longer than any one step.
SCALE_TIMEOUT_S = 1800.0


def scale_on_ray(name: str, address: str = "auto", prefill: int | None = None, decode: int | None = None,
                 timeout_s: float = SCALE_TIMEOUT_S) -> dict[str, Any]:
    """Scale the deployment `name` on the Ray cluster at `address` ("auto": the one
    `ray start` runs on this machine, or the job's; or host:port) and return the
    result: {"prefill": N, "decode": M, "added": [...], "removed": [...],
    "moved_requests": K, "seconds": S}; with neither pool given, its pools as they are
    (DeploymentActor.pools()). In a process already connected to Ray, that connection
    is used. Raises the deployment's ScaleError (a ValueError: a target out of bounds)
    or ScaleFailed (a RuntimeError: a worker did not start), LookupError (no such
    deployment), PlacementError (no Ray cluster there), TimeoutError (not done within
    timeout_s; it goes on in the deployment), RuntimeError (the deployment died)."""
    joined = _join(address)
    try:
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            raise LookupError(f"no pdserve deployment named {name!r} on the Ray cluster at {address!r} "
                              f"(namespace {NAMESPACE!r}; its config's ray.name)") from None
        call: ray.ObjectRef[dict[str, Any]] = (actor.pools.remote() if prefill is None and decode is None
                                               else actor.scale.remote(prefill, decode))
        try:
            return unwrap(lambda: ray.get(call, timeout=timeout_s))
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"the deployment {name!r} did not answer within {timeout_s:g} s; a scale goes "
                               "on there (`pdserve scale NAME` alone shows the pools)") from None
        except ray.exceptions.RayActorError as exc:
            raise RuntimeError(f"the deployment {name!r} is gone: {exc}") from None
    finally:
        if joined:
            ray.shutdown()


def _join(address: str) -> bool:
    """Connect this process to the Ray cluster at `address`; False if it already was."""
    if address == "local":
        if not os.environ.get("RAY_ADDRESS"):
            # A private Ray (ray.init's own start) leaves no address for others to find.
            raise ValueError("ray.address 'local': the deployment runs on a private Ray that no other command "
                             "can join; scale it through its router instead (`pdserve scale --url URL`, with "
                             "router.admin_keys set), or serve it on a `ray start` cluster (ray.address: auto)")
        address = "auto"  # inside a Ray job: the job's cluster
    if ray.is_initialized():
        return False
    probe_address(address)
    # The deployment's and its workers' logs stay in their own terminals.
    ray.init(address=address, log_to_driver=False)
    return True
