"""Every field of every config dataclass is type-checked, and the error names its path
in the YAML file: `"512"` is no token count, `"false"` is not false, 1.5 is no block count."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import pytest

from cluster.config import (
    ROLE_FIELDS,
    ClusterConfig,
    ConfigError,
    PoolConfig,
    RayConfig,
    RayPoolConfig,
    RouterConfig,
    TransportOptions,
    load_cluster_config,
)
from cluster.lora_config import ENGINE_FIELDS as LORA_FIELDS
from cluster.lora_config import LoRAConfig
from engine.config import EngineConfig
from engine.config_check import FieldTypeError, check_field_types

BASE = {"model": "m", "prefill": {"replicas": 1}, "decode": {"replicas": 1}}
# Dataclass -> where its fields sit in the YAML (the path an error names).
SECTIONS: list[tuple[type, tuple[str, ...]]] = [
    (ClusterConfig, ()), (RouterConfig, ("router",)), (PoolConfig, ("prefill",)), (PoolConfig, ("decode",)),
    (EngineConfig, ("decode", "engine")), (EngineConfig, ("prefill", "engine")), (RayConfig, ("ray",)),
    (RayPoolConfig, ("ray", "prefill")), (RayPoolConfig, ("ray", "decode")), (TransportOptions, ("transport_options",)),
    (LoRAConfig, ("lora",)),
]
# A value of each type that another type's field must refuse.
WRONG: dict[Any, list[Any]] = {int: [True, 1.5, "1", None], float: [True, "1.0", None], bool: ["false", 1, None],
                               str: [3, True, None], dict: [[1], "a", None],
                               # Any: a field of several spellings its section checks itself
                               # (router.api_keys; tests/unit/test_router_auth_config.py).
                               Any: [3, True]}


def _base(annotation: Any) -> Any:
    """The annotation without `| None`, and `dict[...]` as dict."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    return typing.get_origin(annotation) or annotation


def _cases() -> list[tuple[str, dict, Any]]:
    cases = []
    for cls, where in SECTIONS:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            base, optional = _base(hints[f.name]), type(None) in typing.get_args(hints[f.name])
            if dataclasses.is_dataclass(base) or (cls is EngineConfig and f.name in ROLE_FIELDS + LORA_FIELDS):
                continue  # a nested section (checked field by field itself), or set at the top or in `lora`
            for bad in WRONG[base]:
                if bad is None and optional:
                    continue
                cases.append((".".join((*where, f.name)), _nest(where, {f.name: bad}), bad))
    return cases


def _nest(where: tuple[str, ...], leaf: dict) -> dict:
    data = {**BASE}
    node = data
    for key in where:
        node[key] = {**node.get(key, {})}
        node = node[key]
    node.update(leaf)
    return data


@pytest.mark.parametrize("path,data,bad", _cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_field_refuses_a_value_of_another_type(path: str, data: dict, bad: Any) -> None:
    with pytest.raises(ConfigError) as err:
        ClusterConfig.from_dict(data)
    assert str(err.value).startswith(f"{path}: must be "), str(err.value)
    assert str(err.value).endswith(f"got {bad!r}")


@pytest.mark.parametrize("yaml_line,message", [
    ('decode: {engine: {max_num_batched_tokens: "512"}}',
     "decode.engine.max_num_batched_tokens: must be an integer, got '512'"),
    ('prefill: {engine: {enable_prefix_caching: "false"}}',
     "prefill.engine.enable_prefix_caching: must be true or false, got 'false'"),
    ("decode: {engine: {num_kv_blocks: 1.5}}", "decode.engine.num_kv_blocks: must be an integer, got 1.5"),
    ("decode: {engine: {enforce_eager: 1}}", "decode.engine.enforce_eager: must be true or false, got 1"),
    ("decode: {replicas: true}", "decode.replicas: must be an integer, got True"),
    ("router: {port: 8000.0}", "router.port: must be an integer, got 8000.0"),
    ("ray: {decode: {resources: {gpu_node: [1]}}}", "ray.decode.resources.gpu_node: must be a number, got [1]"),
    ("transport_options: {cancel_grace_s: 5s}", "transport_options.cancel_grace_s: must be a number, got '5s'"),
    # A field with a fixed set of values is told them, whatever the wrong value's type.
    ("dtype: 3", "dtype: must be one of ('float32', 'bfloat16', 'float16'), got 3"),
    ("launcher: [ray]", "launcher: must be one of ('local', 'ray'), got ['ray']"),
    ("router: {policy: 1}", "router.policy: must be one of ('round_robin', 'least_loaded', 'kv_aware'), got 1"),
    ("ray: {strategy: false}", "ray.strategy: must be one of ('PACK', 'SPREAD'), got False"),
])
def test_yaml_type_mistakes_name_their_path(tmp_path: Path, yaml_line: str, message: str) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(f"model: m\n{yaml_line}\n")
    with pytest.raises(ConfigError) as err:
        load_cluster_config(path)
    assert str(err.value) == message


def test_int_is_a_valid_float_and_null_a_valid_optional() -> None:
    cfg = ClusterConfig.from_dict({**BASE, "prefill_deadline_s": 5, "transport_options": {"timeout_s": 3},
                                   "router": {"stall_timeout_s": None, "health_interval_s": 2},
                                   "ray": {"num_cpus": None, "decode": {"num_cpus": 2, "resources": {"n": 1}}},
                                   "decode": {"engine": {"num_kv_blocks": None, "kv_cache_memory_gib": 2,
                                                         "max_model_len": None, "gpu_memory_utilization": 1}}})
    assert cfg.prefill_deadline_s == 5.0 and cfg.transport_options.timeout_s == 3.0
    assert cfg.router.stall_timeout_s is None and cfg.ray.num_cpus is None and cfg.ray.decode.num_cpus == 2.0
    engine = cfg.engine_config("decode")
    assert engine.num_kv_blocks is None and engine.kv_cache_memory_gib == 2


def test_engine_options_are_checked_offline_too() -> None:
    """The offline engine's keyword options: a ValueError naming the field, not a bare
    TypeError from a comparison (nor a string taken for true)."""
    with pytest.raises(FieldTypeError, match=r"^max_num_batched_tokens: must be an integer, got '512'$"):
        EngineConfig(model="m", max_num_batched_tokens="512")
    with pytest.raises(ValueError, match=r"^enable_prefix_caching: must be true or false, got 'false'$"):
        EngineConfig.from_options("m", enable_prefix_caching="false")
    with pytest.raises(ValueError, match=r"^num_kv_blocks: must be an integer, got 1.5$"):
        EngineConfig(model="m", num_kv_blocks=1.5)
    with pytest.raises(ValueError, match=r"^device: must be a string, got 0$"):
        EngineConfig(model="m", device=0)
    assert EngineConfig(model="m", kv_cache_memory_gib=2, num_threads=None).kv_cache_memory_gib == 2


def test_the_checker_refuses_annotations_it_cannot_check() -> None:
    """A field whose annotation the checker does not know is a programming error, not a
    field left unchecked."""
    @dataclasses.dataclass
    class Odd:
        sizes: list[int] = dataclasses.field(default_factory=list)

    @dataclasses.dataclass
    class Either:
        value: int | str = 0

    with pytest.raises(TypeError, match="unsupported annotation"):
        check_field_types(Odd, {"sizes": [1]})
    with pytest.raises(TypeError, match="only X | None"):
        check_field_types(Either, {"value": 1})
    check_field_types(Odd, {"other": "names that are no field are the caller's to refuse"})


def test_every_config_dataclass_annotation_is_checkable() -> None:
    """Each section's default values pass its own checks (and so every annotation is one
    the checker supports)."""
    for cls in {cls for cls, _ in SECTIONS}:
        defaults = {f.name: getattr(cls(model="m") if cls in (ClusterConfig, EngineConfig) else cls(), f.name)
                    for f in dataclasses.fields(cls)}
        check_field_types(cls, defaults)
