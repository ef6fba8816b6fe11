"""The cluster config: one YAML file describes model, pools, transport and router.

Everything is validated before anything starts. Each mistake is named with its path
in the file, e.g. `decode.replicas: must be >= 1, got 0`, every value is checked
against its field's type (engine/config_check.py), and unknown keys are refused (a
typo never silently falls back to a default).

    model: models/SmolLM2-135M-Instruct
    dtype: float32
    device: cpu
    load_format: safetensors        # or dummy: weights generated from the seed (engine/model/dummy_weights.py)
    transport: shm                  # kv_transfer/ name: nixl | shm | nccl | tcp | cuda_ipc
    transport_options: {timeout_s: 10.0, cancel_grace_s: 10.0}
    router: {host: 127.0.0.1, port: 8000, policy: kv_aware, remote_prefill_min_tokens: 64}
    prefill: {replicas: 1, engine: {max_num_batched_tokens: 512}}
    decode:  {replicas: 1, engine: {max_num_seqs: 64}}
    launcher: local                 # local (processes) | ray (placement groups + actors)
    ray: {address: local, num_cpus: 2, strategy: PACK, decode: {num_cpus: 1, resources: {}}}
    local: {max_restarts: 3}        # read only by the local launcher
    autoscale: {enabled: true, decode: {min: 1, max: 4}}   # cluster/autoscale/config.py
    lora: {adapters: {sql: adapters/sql}, max_loras: 4}     # cluster/lora_config.py
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cluster.autoscale.config import AutoscaleConfig
from cluster.config_fields import ConfigError, check, checked_mapping, integer, number
from cluster.lora_config import ENGINE_FIELDS as LORA_FIELDS
from cluster.lora_config import LoRAConfig
from cluster.model_checks import check_pools_share_kv_format, check_store_holds_a_block
from cluster.router_config import POLICIES, RouterConfig
from engine.config import DTYPES, LOAD_FORMATS, EngineConfig
from engine.config_check import FieldTypeError
from engine.distributed.sharding import check_shardable
from engine.model.config import ModelConfig
from engine.speculative.config import SpeculativeConfig
from kv_transfer import CPU_ONLY, GPU_ONLY, TRANSPORTS, TransportConfig
from kv_transfer.config import STREAM_MODES

__all__ = ["ClusterConfig", "ConfigError", "LocalConfig", "PoolConfig", "POLICIES", "RayConfig", "RayPoolConfig",
           "RouterConfig", "TransportOptions", "check_ray_model_dir", "load_cluster_config"]

LAUNCHERS = ("local", "ray")
# Ray placement strategies between the workers of a pool (a worker is one bundle, and a
# bundle is always on one node, so each worker is packed by construction).
STRATEGIES = ("PACK", "SPREAD")
# Set once at the top, not per pool: a prefill and a decode worker must run the same model.
ROLE_FIELDS = ("model", "dtype", "device", "load_format")


@dataclass(frozen=True)
class PoolConfig:
    replicas: int = 1
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig options but model/dtype/device

    @classmethod
    def from_dict(cls, data: Any, path: str, minimum: int) -> PoolConfig:
        data = checked_mapping(cls, data, path)
        out = cls(**data)
        integer(out.replicas, f"{path}.replicas", minimum)
        check(isinstance(out.engine, dict), f"{path}.engine", f"must be a mapping, got {out.engine!r}")
        for key in ROLE_FIELDS:
            check(key not in out.engine, f"{path}.engine.{key}", "is set once, at the top of the file")
        for key in LORA_FIELDS:
            check(key not in out.engine, f"{path}.engine.{key}", "is set once, for both pools, in the lora section")
        return out


def _check_shardable(model: str, size: int, expert_parallel: bool, path: str) -> None:
    """Before any worker starts: the model's heads must split over `size` ranks. Only
    where the model is readable here (under Ray it may live on other nodes only)."""
    if not os.path.isfile(os.path.join(model, "config.json")):
        return
    try:
        check_shardable(ModelConfig.from_model_dir(model), size, expert_parallel)
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
    def from_dict(cls, data: Any, path: str) -> RayPoolConfig:
        data = checked_mapping(cls, data, path)
        num_cpus = number(data.get("num_cpus", 1.0), f"{path}.num_cpus", 0, strict=True)
        num_gpus = number(data.get("num_gpus", 0.0), f"{path}.num_gpus", 0)
        resources = data.get("resources", {})
        check(isinstance(resources, dict), f"{path}.resources", f"must be a mapping, got {resources!r}")
        for name, amount in resources.items():
            check(isinstance(name, str) and name not in ("CPU", "GPU", "memory"), f"{path}.resources",
                  f"{name!r} is not a custom resource name (use num_cpus / num_gpus)")
            number(amount, f"{path}.resources.{name}", 0, strict=True)
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
    def from_dict(cls, data: Any, path: str = "ray") -> RayConfig:
        data = checked_mapping(cls, data, path, {"strategy": STRATEGIES})
        address = data.get("address", "local")
        check(isinstance(address, str) and _valid_address(address), f"{path}.address",
              f"must be 'local', 'auto', 'host:port' or 'ray://host:port', got {address!r}")
        num_cpus = data.get("num_cpus")
        if num_cpus is not None:
            integer(num_cpus, f"{path}.num_cpus", 1)
            check(address == "local", f"{path}.num_cpus", f"sizes a local start only; address is {address!r}")
        strategy = data.get("strategy", "PACK")
        check(strategy in STRATEGIES, f"{path}.strategy", f"must be one of {STRATEGIES}, got {strategy!r}")
        timeout = number(data.get("placement_timeout_s", 15.0), f"{path}.placement_timeout_s", 0, strict=True)
        return cls(address, num_cpus, strategy, timeout,
                   RayPoolConfig.from_dict(data.get("prefill", {}), f"{path}.prefill"),
                   RayPoolConfig.from_dict(data.get("decode", {}), f"{path}.decode"),
                   integer(data.get("max_restarts", 3), f"{path}.max_restarts", 0),
                   number(data.get("probe_interval_s", 1.0), f"{path}.probe_interval_s", 0, strict=True),
                   number(data.get("probe_timeout_s", 5.0), f"{path}.probe_timeout_s", 0, strict=True),
                   _name(data.get("name", "pdserve"), f"{path}.name"))


def _name(value: Any, path: str) -> str:
    check(isinstance(value, str) and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", value) is not None, path,
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
    def from_dict(cls, data: Any, path: str = "local") -> LocalConfig:
        data = checked_mapping(cls, data, path)
        return cls(integer(data.get("max_restarts", 3), f"{path}.max_restarts", 0))


@dataclass(frozen=True)
class TransportOptions:
    """The KV transport's settings a config file sets (kv_transfer.TransportConfig, whose
    defaults these are). One section for every worker of both pools: a sender and its
    receiver must agree on cancel_grace_s (kv_transfer/receiver.py)."""
    timeout_s: float = TransportConfig.timeout_s
    cancel_grace_s: float = TransportConfig.cancel_grace_s
    progress_thread: bool = TransportConfig.progress_thread
    stream: str = TransportConfig.stream
    stream_min_tokens: int = TransportConfig.stream_min_tokens
    stream_layers: int = TransportConfig.stream_layers

    @classmethod
    def from_dict(cls, data: Any, path: str = "transport_options") -> TransportOptions:
        if isinstance(data, dict) and data.get("stream") is False:
            data = {**data, "stream": "off"}  # YAML 1.1 reads an unquoted `stream: off` as false
        data = checked_mapping(cls, data, path)
        out = cls(**data)
        check(out.stream in STREAM_MODES, f"{path}.stream", f"must be one of {STREAM_MODES}, got {out.stream!r}")
        return cls(number(out.timeout_s, f"{path}.timeout_s", 0, strict=True),
                   number(out.cancel_grace_s, f"{path}.cancel_grace_s", 0, strict=True), out.progress_thread,
                   out.stream, integer(out.stream_min_tokens, f"{path}.stream_min_tokens", 0),
                   integer(out.stream_layers, f"{path}.stream_layers", 1))


@dataclass(frozen=True)
class KVStoreConfig:
    """The KV store the deployment's workers share (kv_store/), below each worker's
    offload tiers: the launcher starts it, and every worker whose pool has a host tier
    (<pool>.engine.kv_offload_gib) puts the blocks it offloads there and loads prefixes
    from it."""
    enabled: bool = False
    capacity_gib: float = 4.0  # the store's memory for blocks, least recently used evicted
    # A worker waits this long for a fetch before it computes the blocks instead.
    fetch_timeout_s: float = 1.0

    @classmethod
    def from_dict(cls, data: Any, path: str = "kv_store") -> KVStoreConfig:
        data = checked_mapping(cls, data, path)
        out = cls(**data)
        timeout = number(out.fetch_timeout_s, f"{path}.fetch_timeout_s", 0, strict=True)
        # A worker's close waits for a fetch in flight (its tiers' I/O thread) up to 10 s.
        check(timeout <= 5.0, f"{path}.fetch_timeout_s", f"must be <= 5 seconds, got {timeout:g}")
        return cls(out.enabled, number(out.capacity_gib, f"{path}.capacity_gib", 0, strict=True), timeout)


@dataclass(frozen=True)
class ClusterConfig:
    model: str
    dtype: str = "float32"
    device: str = "cpu"
    load_format: str = "safetensors"
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
    # Pool bounds (for the planner and `pdserve scale`), SLO targets, thresholds, timing.
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    kv_store: KVStoreConfig = field(default_factory=KVStoreConfig)
    lora: LoRAConfig | None = None  # LoRA adapters served beside the model (cluster/lora_config.py); None: off

    @classmethod
    def from_dict(cls, data: Any) -> ClusterConfig:
        data = checked_mapping(cls, data, "", {"dtype": DTYPES, "transport": sorted(TRANSPORTS), "launcher": LAUNCHERS,
                                               "load_format": LOAD_FORMATS})
        check("model" in data, "model", "is required (a Hugging Face model directory)")
        check(isinstance(data["model"], str) and data["model"] != "", "model",
              f"must be a model directory path, got {data['model']!r}")
        transport = data.get("transport", "shm")
        device = data.get("device", "cpu")
        check(data.get("dtype", "float32") in DTYPES, "dtype",
              f"must be one of {DTYPES}, got {data.get('dtype')!r}")
        check(isinstance(device, str) and (device == "cpu" or device.startswith("cuda")), "device",
              f"must be 'cpu' or 'cuda[:N]', got {device!r}")
        load_format = data.get("load_format", "safetensors")
        check(load_format in LOAD_FORMATS, "load_format", f"must be one of {LOAD_FORMATS}, got {load_format!r}")
        check(transport in TRANSPORTS, "transport", f"must be one of {sorted(TRANSPORTS)}, got {transport!r}")
        on_gpu = isinstance(device, str) and device.startswith("cuda")
        check(not (on_gpu and transport in CPU_ONLY), "transport",
              f"{transport!r} moves CPU caches; with device {device!r} use one of "
               f"{sorted(set(TRANSPORTS) - CPU_ONLY)}")
        check(on_gpu or transport not in GPU_ONLY, "transport",
              f"{transport!r} needs device cuda, got {device!r}")
        deadline = data.get("prefill_deadline_s", 30.0)
        check(isinstance(deadline, (int, float)) and not isinstance(deadline, bool) and deadline > 0,
              "prefill_deadline_s", f"must be a number of seconds > 0, got {deadline!r}")
        launcher = data.get("launcher", "local")
        check(launcher in LAUNCHERS, "launcher", f"must be one of {LAUNCHERS}, got {launcher!r}")
        ray = RayConfig.from_dict(data.get("ray", {}))
        out = cls(model=data["model"], dtype=data.get("dtype", "float32"), device=device,
                  load_format=load_format, transport=transport, transport_options=TransportOptions.from_dict(data.get("transport_options", {})),
                  prefill_deadline_s=float(deadline), router=RouterConfig.from_dict(data.get("router", {})),
                  prefill=PoolConfig.from_dict(data.get("prefill", {}), "prefill", minimum=0),
                  decode=PoolConfig.from_dict(data.get("decode", {}), "decode", minimum=1),
                  launcher=launcher, ray=ray, local=LocalConfig.from_dict(data.get("local", {})),
                  autoscale=AutoscaleConfig.from_dict(data.get("autoscale")),
                  kv_store=KVStoreConfig.from_dict(data.get("kv_store", {})), lora=LoRAConfig.from_dict(data.get("lora"), model=data["model"]))
        if out.lora is not None:
            names = set(out.router.served_model_name or (out.model, Path(out.model).name))
            taken = sorted(names & set(out.lora.adapters))
            check(not taken, f"lora.adapters.{taken[0] if taken else ''}", "is a name of the model itself")
        out.autoscale.check_cluster({role: getattr(out, role).replicas for role in ("prefill", "decode")},
                                    out.router.remote_prefill_min_tokens)
        for role in ("prefill", "decode"):  # Ray hides every GPU from an actor that asks for none
            check(launcher != "ray" or not on_gpu or getattr(out, role).replicas == 0
                  or getattr(ray, role).num_gpus >= 1, f"ray.{role}.num_gpus",
                   f"must be >= 1 with device {device!r}, got {getattr(ray, role).num_gpus:g}")
        for role in ("prefill", "decode"):
            _check_speculative(getattr(out, role).engine.get("speculative_config"), role)
        for role in ("prefill", "decode"):  # the engine's own checks, named with their path
            try:
                engine = out.engine_config(role)
            except FieldTypeError as exc:
                raise ConfigError(f"{role}.engine.{exc}") from None
            except ValueError as exc:
                raise ConfigError(f"{role}.engine: {exc}") from None
            if getattr(out, role).replicas and (engine.tensor_parallel_size > 1 or engine.enable_expert_parallel):
                _check_shardable(out.model, engine.tensor_parallel_size, engine.enable_expert_parallel,
                                 f"{role}.engine.tensor_parallel_size")
        if out.kv_store.enabled:
            # The store's port is found free on the launcher's node (cluster/ray/kv_store.py):
            # a Ray Client driver is on no node of the cluster.
            check(launcher != "ray" or not out.ray.address.startswith("ray://"), "kv_store.enabled",
                  "the Ray launcher starts the store on its own node, which a Ray Client (ray.address "
                  "ray://...) driver is not: submit the deployment as a Ray job (ray job submit) instead")
            with_tier = [r for r in ("prefill", "decode") if out.engine_config(r).kv_offload_gib > 0]
            check(bool(with_tier), "kv_store.enabled", "no pool has a host tier to reach the store through: "
                  "set <pool>.engine.kv_offload_gib > 0 on the pools that should share it")
            check_store_holds_a_block(out, with_tier)
        if out.prefill.replicas and out.decode.replicas:  # the transports' handshake refuses it later
            sizes = {role: out.engine_config(role).block_size for role in ("prefill", "decode")}
            check(sizes["prefill"] == sizes["decode"], "prefill.engine.block_size",
                  f"must equal decode.engine.block_size (a prefill worker writes whole blocks of the "
                  f"decode worker's), got {sizes['prefill']} and {sizes['decode']}")
            check_pools_share_kv_format(out)
            check(out.transport_options.stream != "layer" or out.engine_config("prefill").tensor_parallel_size == 1,
                  "transport_options.stream", "layer needs prefill.engine.tensor_parallel_size 1 (each rank of a "
                  "TP prefill worker computes its layers in its own process, where the writer cannot see them): "
                  "use chunk")
        if load_format == "dummy" and out.prefill.replicas:  # the seed draws the weights: one model for both pools
            seeds = {role: out.engine_config(role).seed for role in ("prefill", "decode")}
            check(seeds["prefill"] == seeds["decode"], "decode.engine.seed",
                  f"must equal prefill.engine.seed with load_format dummy (the seed generates the weights), "
                  f"got {seeds['decode']} and {seeds['prefill']}")
        return out

    def engine_config(self, role: str) -> EngineConfig:
        pool: PoolConfig = getattr(self, role)
        lora = self.lora.engine_options() if self.lora is not None else {}
        return EngineConfig.from_options(self.model, dtype=self.dtype, device=self.device,
                                         load_format=self.load_format, **pool.engine, **lora)

    def transport_config(self, host: str) -> TransportConfig:
        """The KV transport's config of a worker whose control socket listens on host."""
        return TransportConfig(host=host, **dataclasses.asdict(self.transport_options))


def _check_speculative(value: Any, role: str) -> None:
    """`<role>.engine.speculative_config`, named with its path to the key at fault."""
    if value is None:
        return
    path = f"{role}.engine.speculative_config"
    check(role != "prefill", path, "a prefill worker never samples (it computes prompt KV for the decode workers), "
          "so drafts would be proposed or loaded for nothing; set it on decode.engine")
    checked_mapping(SpeculativeConfig, value, path)
    check("num_speculative_tokens" in value, f"{path}.num_speculative_tokens", "is required")
    try:
        SpeculativeConfig(**value)
    except ValueError as exc:  # its own message starts "speculative_config: "
        raise ConfigError(f"{path}: {str(exc).removeprefix('speculative_config: ')}") from None


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
