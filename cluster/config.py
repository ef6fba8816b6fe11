"""The cluster config: one YAML file describes model, pools, transport and router.

Everything is validated before anything starts. Each mistake is named with its path
in the file, e.g. `decode.replicas: must be >= 1, got 0`, every value is checked
against its field's type (engine/config_check.py), and unknown keys are refused (a
typo never silently falls back to a default).

    model: models/SmolLM2-135M-Instruct
    dtype: float32
    device: cpu
    transport: shm                  # kv_transfer/ name: nixl | shm | nccl | tcp | cuda_ipc
    transport_options: {timeout_s: 10.0, cancel_grace_s: 10.0}
    router: {host: 127.0.0.1, port: 8000, policy: kv_aware, remote_prefill_min_tokens: 64}
    prefill: {replicas: 1, engine: {max_num_batched_tokens: 512}}
    decode:  {replicas: 1, engine: {max_num_seqs: 64}}
    launcher: local                 # local (processes) | ray (placement groups + actors)
    ray: {address: local, num_cpus: 2, strategy: PACK, decode: {num_cpus: 1, resources: {}}}
    local: {max_restarts: 3}        # read only by the local launcher
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cluster.api_keys import is_loopback, resolve_api_keys
from engine.config import DTYPES, EngineConfig
from engine.config_check import FieldTypeError, check_field_types
from engine.distributed.sharding import check_shardable
from engine.model.config import ModelConfig
from kv_transfer import CPU_ONLY, GPU_ONLY, TRANSPORTS, TransportConfig
from router.tool_parsers import TOOL_PARSERS

POLICIES = ("round_robin", "least_loaded", "kv_aware")
LAUNCHERS = ("local", "ray")
# Ray placement strategies between the workers of a pool (a worker is one bundle, and a
# bundle is always on one node, so each worker is packed by construction).
STRATEGIES = ("PACK", "SPREAD")
ROLE_FIELDS = ("model", "dtype", "device")  # set once at the top, not per pool


class ConfigError(ValueError):
    """A cluster config mistake, named with its path in the file."""


def _check(ok: bool, path: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{path}: {message}")


def _fields(cls: type, data: Any, path: str, choices: dict[str, Any] | None = None) -> dict[str, Any]:
    """The mapping `data` checked against cls's fields: a mapping, no unknown keys, each
    value of its field's type (nested sections are checked by their own from_dict). A
    field with `choices` of the wrong type is told its choices, not only its type."""
    _check(isinstance(data, dict), path or "config", f"must be a mapping, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known, key=str)
    prefix = f"{path}." if path else ""
    _check(not unknown, f"{prefix}{unknown[0] if unknown else ''}",
           f"unknown key; known keys here: {sorted(known)}")
    try:
        check_field_types(cls, data)
    except FieldTypeError as exc:
        name = exc.path.split(".")[0]
        if choices and name in choices:
            raise ConfigError(f"{prefix}{name}: must be one of {choices[name]}, got {data[name]!r}") from None
        raise ConfigError(f"{prefix}{exc}") from None
    return data


def _int(value: Any, path: str, minimum: int, maximum: int | None = None) -> int:
    _check(isinstance(value, int) and not isinstance(value, bool), path,
           f"must be an integer, got {value!r}")
    _check(value >= minimum, path, f"must be >= {minimum}, got {value}")
    _check(maximum is None or value <= maximum, path, f"must be <= {maximum}, got {value}")
    return value


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "kv_aware"
    # A request goes to the prefill pool only when this many prompt tokens are not
    # already cached on its decode worker (conditional disaggregation).
    remote_prefill_min_tokens: int = 64
    max_queued_requests: int = 256  # beyond: HTTP 429
    # A decode worker sends at most this many remote prefills to one prefill worker at
    # a time; past it (the pool is saturated) it prefills locally instead.
    prefill_max_outstanding: int = 16
    # Decode-worker supervision (router/health.py): a `stats` ping every
    # health_interval_s; a worker silent (no tokens, no ping reply) for worker_timeout_s
    # is dead: no new requests, and its requests fail over to a live worker. The
    # timeout must exceed the longest engine step (a long prefill, a first-use kernel
    # compile), or a busy worker is taken for dead (harmless but wasteful: its requests
    # move, and it is re-admitted at its next reply).
    health_interval_s: float = 1.0
    worker_timeout_s: float = 10.0
    # A worker (either pool) with work in its engine's queues whose steps compute no
    # token for this long is stalled: its stats replies say so (the router fails its
    # requests over), and it exits to be restarted (workers/loop.py). So does one
    # whose loop does not come round for this long (a step that never returns). Must
    # exceed the longest engine step, and worker_timeout_s. None or 0: off.
    stall_timeout_s: float | None = 60.0
    # How the served model writes a tool call, read back out of its text when a request
    # with tools lets it choose (tool_choice "auto"): router/tool_parsers.py.
    tool_call_parser: str = "hermes"
    # API keys (cluster/api_keys.py: a list, "env:NAME" or "file:PATH"), a tuple once
    # loaded, never in a repr; router/http_guard.py checks them. Serving a non-loopback
    # host without keys must be asked for (allow_unauthenticated).
    api_keys: Any = field(default=None, repr=False)
    metrics_need_key: bool = True
    allow_unauthenticated: bool = False
    # Input bounds (docs/configs.md says why each default): body bytes (413) and arrival
    # time (408), chat messages, `stop` entries, characters of strings the context length
    # does not bound (400 each), requests waiting for the tokenizer (429).
    max_body_bytes: int = 8 * 1024 * 1024
    body_timeout_s: float = 30.0
    max_messages: int = 2048
    max_stop: int = 64
    max_string_chars: int = 65536
    max_tokenize_queue: int = 64
    # Per-key limits (router/limits.py), off when null: requests per second (a bucket of
    # key_burst, default one second's worth) and tokens in flight (prompt + max_tokens of
    # the key's running requests). Without api_keys every caller counts as one key.
    key_requests_per_s: float | None = None
    key_burst: int | None = None
    key_tokens_in_flight: int | None = None

    @classmethod
    def from_dict(cls, data: Any, path: str = "router") -> "RouterConfig":
        data = _fields(cls, data, path, {"policy": POLICIES, "tool_call_parser": tuple(TOOL_PARSERS)})
        try:
            data = {**data, "api_keys": resolve_api_keys(data.get("api_keys")) or None}
        except ValueError as exc:
            raise ConfigError(f"{path}.api_keys: {exc}") from None
        out = cls(**data)
        _check(isinstance(out.host, str) and out.host != "", f"{path}.host", f"must be a host name, got {out.host!r}")
        _int(out.port, f"{path}.port", 0, 65535)
        _check(out.policy in POLICIES, f"{path}.policy", f"must be one of {POLICIES}, got {out.policy!r}")
        _check(out.tool_call_parser in TOOL_PARSERS, f"{path}.tool_call_parser",
               f"must be one of {tuple(TOOL_PARSERS)}, got {out.tool_call_parser!r}")
        _int(out.remote_prefill_min_tokens, f"{path}.remote_prefill_min_tokens", 1)
        _int(out.max_queued_requests, f"{path}.max_queued_requests", 1)
        _int(out.prefill_max_outstanding, f"{path}.prefill_max_outstanding", 1)
        interval = _number(out.health_interval_s, f"{path}.health_interval_s", 0, strict=True)
        timeout = _number(out.worker_timeout_s, f"{path}.worker_timeout_s", 0, strict=True)
        _check(timeout > interval, f"{path}.worker_timeout_s",
               f"must be > health_interval_s ({interval:g}), or a live worker between pings is taken "
               f"for dead; got {timeout:g}")
        stall = out.stall_timeout_s
        if stall is not None:
            stall = _number(stall, f"{path}.stall_timeout_s", 0)
            _check(stall == 0 or stall > timeout, f"{path}.stall_timeout_s",
                   f"must be > worker_timeout_s ({timeout:g}), which is sized to exceed the longest engine step "
                   f"(a worker in a long step would be taken for hung), or 0 (off); got {stall:g}")
        _check(out.api_keys is not None or out.allow_unauthenticated or is_loopback(out.host),
               f"{path}.allow_unauthenticated", f"must be true to serve {path}.host {out.host!r} (not a loopback "
               f"address: other machines reach it) without {path}.api_keys; set api_keys (e.g. 'env:PDSERVE_API_KEYS') "
               "or, to serve anyone who reaches the port, allow_unauthenticated: true")
        for name in ("max_body_bytes", "max_messages", "max_stop", "max_string_chars", "max_tokenize_queue",
                     "key_burst", "key_tokens_in_flight"):
            if getattr(out, name) is not None:  # only the key_* ones may be
                _int(getattr(out, name), f"{path}.{name}", 1)
        rate = out.key_requests_per_s
        rate = None if rate is None else _number(rate, f"{path}.key_requests_per_s", 0, strict=True)
        _check(rate is not None or out.key_burst is None, f"{path}.key_burst",
               "needs key_requests_per_s (the rate its bucket refills at)")
        return dataclasses.replace(out, health_interval_s=interval, worker_timeout_s=timeout,
                                   stall_timeout_s=stall or None, key_requests_per_s=rate,
                                   body_timeout_s=_number(out.body_timeout_s, f"{path}.body_timeout_s", 0, strict=True))


@dataclass(frozen=True)
class PoolConfig:
    replicas: int = 1
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig options but model/dtype/device

    @classmethod
    def from_dict(cls, data: Any, path: str, minimum: int) -> "PoolConfig":
        data = _fields(cls, data, path)
        out = cls(**data)
        _int(out.replicas, f"{path}.replicas", minimum)
        _check(isinstance(out.engine, dict), f"{path}.engine", f"must be a mapping, got {out.engine!r}")
        for key in ROLE_FIELDS:
            _check(key not in out.engine, f"{path}.engine.{key}", "is set once, at the top of the file")
        return out


def _number(value: Any, path: str, minimum: float, *, strict: bool = False) -> float:
    _check(isinstance(value, (int, float)) and not isinstance(value, bool), path, f"must be a number, got {value!r}")
    _check(math.isfinite(value), path, f"must be finite, got {value}")
    _check(value > minimum if strict else value >= minimum, path,
           f"must be {'>' if strict else '>='} {minimum}, got {value}")
    return float(value)


def _check_shardable(model: str, size: int, path: str) -> None:
    """Before any worker starts: the model's heads must split over `size` ranks. Only
    where the model is readable here (under Ray it may live on other nodes only)."""
    if not os.path.isfile(os.path.join(model, "config.json")):
        return
    try:
        check_shardable(ModelConfig.from_model_dir(model), size)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None


@dataclass(frozen=True)
class RayPoolConfig:
    """What each worker of one pool asks Ray for: one placement-group bundle."""
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    # Custom node resources, e.g. {prefill_node: 1} puts the pool on nodes started with
    # `ray start --resources '{"prefill_node": 8}'`.
    resources: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Any, path: str) -> "RayPoolConfig":
        data = _fields(cls, data, path)
        num_cpus = _number(data.get("num_cpus", 1.0), f"{path}.num_cpus", 0, strict=True)
        num_gpus = _number(data.get("num_gpus", 0.0), f"{path}.num_gpus", 0)
        resources = data.get("resources", {})
        _check(isinstance(resources, dict), f"{path}.resources", f"must be a mapping, got {resources!r}")
        for name, amount in resources.items():
            _check(isinstance(name, str) and name not in ("CPU", "GPU", "memory"), f"{path}.resources",
                   f"{name!r} is not a custom resource name (use num_cpus / num_gpus)")
            _number(amount, f"{path}.resources.{name}", 0, strict=True)
        return cls(num_cpus, num_gpus, {k: float(v) for k, v in resources.items()})

    def bundle(self) -> dict[str, float]:
        return {"CPU": self.num_cpus, **({"GPU": self.num_gpus} if self.num_gpus else {}), **self.resources}


@dataclass(frozen=True)
class RayConfig:
    # "local": start a private Ray on this machine (or, run as a Ray job, join the job's
    # cluster); "auto": join the cluster `ray start` made here; else "host:port" or
    # "ray://host:port".
    address: str = "local"
    num_cpus: int | None = None  # CPUs of a local start; None: all of the machine's
    strategy: str = "PACK"
    # A cluster that cannot place every worker within this long is an error, not a wait.
    placement_timeout_s: float = 15.0
    prefill: RayPoolConfig = field(default_factory=RayPoolConfig)
    decode: RayPoolConfig = field(default_factory=RayPoolConfig)
    # Supervision (cluster/ray/supervisor.py): Ray restarts a crashed worker up to this many
    # times; every probe_interval_s each worker is asked for its incarnation, and one
    # that does not answer within probe_timeout_s is killed (then restarted): a hung
    # worker must not write KV after its peers stopped expecting it.
    max_restarts: int = 3
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 5.0
    # The deployment's actor name (namespace "pdserve"): `pdserve down` finds it by it.
    name: str = "pdserve"

    @classmethod
    def from_dict(cls, data: Any, path: str = "ray") -> "RayConfig":
        data = _fields(cls, data, path, {"strategy": STRATEGIES})
        address = data.get("address", "local")
        _check(isinstance(address, str) and _valid_address(address), f"{path}.address",
               f"must be 'local', 'auto', 'host:port' or 'ray://host:port', got {address!r}")
        num_cpus = data.get("num_cpus")
        if num_cpus is not None:
            _int(num_cpus, f"{path}.num_cpus", 1)
            _check(address == "local", f"{path}.num_cpus", f"sizes a local start only; address is {address!r}")
        strategy = data.get("strategy", "PACK")
        _check(strategy in STRATEGIES, f"{path}.strategy", f"must be one of {STRATEGIES}, got {strategy!r}")
        timeout = _number(data.get("placement_timeout_s", 15.0), f"{path}.placement_timeout_s", 0, strict=True)
        return cls(address, num_cpus, strategy, timeout,
                   RayPoolConfig.from_dict(data.get("prefill", {}), f"{path}.prefill"),
                   RayPoolConfig.from_dict(data.get("decode", {}), f"{path}.decode"),
                   _int(data.get("max_restarts", 3), f"{path}.max_restarts", 0),
                   _number(data.get("probe_interval_s", 1.0), f"{path}.probe_interval_s", 0, strict=True),
                   _number(data.get("probe_timeout_s", 5.0), f"{path}.probe_timeout_s", 0, strict=True),
                   _name(data.get("name", "pdserve"), f"{path}.name"))


def _name(value: Any, path: str) -> str:
    _check(isinstance(value, str) and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", value) is not None, path,
           f"must be 1-63 letters, digits, '_', '.' or '-', got {value!r}")
    return value


def _valid_address(address: str) -> bool:
    if address in ("local", "auto"):
        return True
    host, _, port = address.removeprefix("ray://").rpartition(":")
    return host != "" and port.isdigit() and 0 < int(port) < 65536


@dataclass(frozen=True)
class LocalConfig:
    """What only the local launcher reads (cluster/local/)."""
    # Supervision (cluster/local/supervisor.py): a worker process that exits is started
    # again up to this many times over the deployment's life, then stays down.
    max_restarts: int = 3

    @classmethod
    def from_dict(cls, data: Any, path: str = "local") -> "LocalConfig":
        data = _fields(cls, data, path)
        return cls(_int(data.get("max_restarts", 3), f"{path}.max_restarts", 0))


@dataclass(frozen=True)
class TransportOptions:
    """The KV transport's settings a config file sets (kv_transfer.TransportConfig, whose
    defaults these are). One section for every worker of both pools: a sender and its
    receiver must agree on cancel_grace_s (kv_transfer/receiver.py)."""
    timeout_s: float = TransportConfig.timeout_s
    cancel_grace_s: float = TransportConfig.cancel_grace_s
    progress_thread: bool = TransportConfig.progress_thread

    @classmethod
    def from_dict(cls, data: Any, path: str = "transport_options") -> "TransportOptions":
        data = _fields(cls, data, path)
        out = cls(**data)
        return cls(_number(out.timeout_s, f"{path}.timeout_s", 0, strict=True),
                   _number(out.cancel_grace_s, f"{path}.cancel_grace_s", 0, strict=True), out.progress_thread)


@dataclass(frozen=True)
class ClusterConfig:
    model: str
    dtype: str = "float32"
    device: str = "cpu"
    transport: str = "shm"
    transport_options: TransportOptions = field(default_factory=TransportOptions)
    # A decode worker waits this long for pushed KV before prefilling locally.
    prefill_deadline_s: float = 30.0
    router: RouterConfig = field(default_factory=RouterConfig)
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    launcher: str = "local"  # how workers start: local processes, or Ray actors
    ray: RayConfig = field(default_factory=RayConfig)  # read only by the ray launcher
    local: LocalConfig = field(default_factory=LocalConfig)  # read only by the local launcher

    @classmethod
    def from_dict(cls, data: Any) -> "ClusterConfig":
        data = _fields(cls, data, "", {"dtype": DTYPES, "transport": sorted(TRANSPORTS), "launcher": LAUNCHERS})
        _check("model" in data, "model", "is required (a Hugging Face model directory)")
        _check(isinstance(data["model"], str) and data["model"] != "", "model",
               f"must be a model directory path, got {data['model']!r}")
        transport = data.get("transport", "shm")
        device = data.get("device", "cpu")
        _check(data.get("dtype", "float32") in DTYPES, "dtype",
               f"must be one of {DTYPES}, got {data.get('dtype')!r}")
        _check(isinstance(device, str) and (device == "cpu" or device.startswith("cuda")), "device",
               f"must be 'cpu' or 'cuda[:N]', got {device!r}")
        _check(transport in TRANSPORTS, "transport", f"must be one of {sorted(TRANSPORTS)}, got {transport!r}")
        on_gpu = isinstance(device, str) and device.startswith("cuda")
        _check(not (on_gpu and transport in CPU_ONLY), "transport",
               f"{transport!r} moves CPU caches; with device {device!r} use one of "
               f"{sorted(set(TRANSPORTS) - CPU_ONLY)}")
        _check(on_gpu or transport not in GPU_ONLY, "transport",
               f"{transport!r} needs device cuda, got {device!r}")
        deadline = data.get("prefill_deadline_s", 30.0)
        _check(isinstance(deadline, (int, float)) and not isinstance(deadline, bool) and deadline > 0,
               "prefill_deadline_s", f"must be a number of seconds > 0, got {deadline!r}")
        launcher = data.get("launcher", "local")
        _check(launcher in LAUNCHERS, "launcher", f"must be one of {LAUNCHERS}, got {launcher!r}")
        ray = RayConfig.from_dict(data.get("ray", {}))
        out = cls(model=data["model"], dtype=data.get("dtype", "float32"), device=device,
                  transport=transport, transport_options=TransportOptions.from_dict(data.get("transport_options", {})),
                  prefill_deadline_s=float(deadline), router=RouterConfig.from_dict(data.get("router", {})),
                  prefill=PoolConfig.from_dict(data.get("prefill", {}), "prefill", minimum=0),
                  decode=PoolConfig.from_dict(data.get("decode", {}), "decode", minimum=1),
                  launcher=launcher, ray=ray, local=LocalConfig.from_dict(data.get("local", {})))
        for role in ("prefill", "decode"):  # Ray hides every GPU from an actor that asks for none
            _check(launcher != "ray" or not on_gpu or getattr(out, role).replicas == 0
                   or getattr(ray, role).num_gpus >= 1, f"ray.{role}.num_gpus",
                   f"must be >= 1 with device {device!r}, got {getattr(ray, role).num_gpus:g}")
        for role in ("prefill", "decode"):  # the engine's own checks, named with their path
            try:
                engine = out.engine_config(role)
            except FieldTypeError as exc:
                raise ConfigError(f"{role}.engine.{exc}") from None
            except ValueError as exc:
                raise ConfigError(f"{role}.engine: {exc}") from None
            if getattr(out, role).replicas and engine.tensor_parallel_size > 1:
                _check_shardable(out.model, engine.tensor_parallel_size, f"{role}.engine.tensor_parallel_size")
        return out

    def engine_config(self, role: str) -> EngineConfig:
        pool: PoolConfig = getattr(self, role)
        return EngineConfig.from_options(self.model, dtype=self.dtype, device=self.device, **pool.engine)

    def transport_config(self, host: str) -> TransportConfig:
        """The KV transport's config of a worker whose control socket listens on host."""
        return TransportConfig(host=host, **dataclasses.asdict(self.transport_options))


def check_ray_model_dir(config: ClusterConfig) -> None:
    """Before a Ray launch starts any actor: the model directory must be readable here,
    where `pdserve serve` runs, or every worker fails loading it, deep in its traceback.
    `ray job submit --working-dir .` uploads the code but not models/ (git-ignored), so
    a relative `models/...` is missing in the job's working directory. Call it after
    any `--model` override."""
    path = Path(config.model)
    if (path / "config.json").is_file():
        return
    where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
    what = "has no config.json" if path.is_dir() else "does not exist"
    raise ConfigError(
        f"model: {config.model!r}{where} {what} on this node, so no Ray worker could load it. Give an absolute "
        f"path every node can read, in the config's `model` or as `pdserve serve CONFIG --model /path/to/model` "
        f"(`ray job submit --working-dir` does not upload models/, which git ignores)")


def load_cluster_config(path: str | Path) -> ClusterConfig:
    """Read and validate a YAML cluster config; ConfigError names every mistake's path."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read cluster config {path}: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    return ClusterConfig.from_dict(data)
