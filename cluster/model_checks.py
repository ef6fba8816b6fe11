"""Checks of a cluster config against its model, run at load where the model's
directory is readable here: the pools' KV formats agree, and the KV store holds a block."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from cluster.config_fields import check
from engine.config import DTYPE_BYTES, kv_cache_format
from engine.model.config import ModelConfig
from kv_store.server import stored_size

if TYPE_CHECKING:
    from cluster.config import ClusterConfig


def check_pools_share_kv_format(config: ClusterConfig) -> None:
    """The decode worker reads the bytes a prefill worker writes: the same cache format,
    from models quantized alike. Compared as they take effect: "fp8" is "fp8_e4m3", and
    no quantization setting on an fp8 checkpoint is fp8 (where the model is readable)."""
    def checkpoint() -> str | None:  # read only where the pools' settings differ: most configs never do
        if not os.path.isfile(os.path.join(config.model, "config.json")):
            return None
        return ModelConfig.from_model_dir(config.model).quantization

    engines = {role: config.engine_config(role) for role in ("prefill", "decode")}
    for name, effective, why in (
            ("kv_cache_dtype", lambda e: kv_cache_format(e.kv_cache_dtype), "the decode worker reads the bytes "
             "a prefill worker writes"),
            ("quantization", lambda e: e.quantization or checkpoint(), "the pools' models would compute different KV")):
        p, d = (getattr(engines[r], name) for r in ("prefill", "decode"))
        check(p == d or effective(engines["prefill"]) == effective(engines["decode"]), f"prefill.engine.{name}",
              f"must equal decode.engine.{name} ({why}), got {p!r} and {d!r}")


def check_store_holds_a_block(config: ClusterConfig, roles: list[str]) -> None:
    """A store smaller than one block refuses every put: said at load, not by a store that
    stays empty. Only where the model is readable here."""
    if not os.path.isfile(os.path.join(config.model, "config.json")):
        return
    model = ModelConfig.from_model_dir(config.model)
    capacity = int(config.kv_store.capacity_gib * 2**30)
    for role in roles:
        engine = config.engine_config(role)
        element = 1 if engine.kv_cache_dtype != "auto" else DTYPE_BYTES[engine.dtype]  # fp8: a byte
        need = stored_size(model.kv_bytes_per_token(element) * engine.block_size,
                           engine.block_size)
        check(capacity >= need, "kv_store.capacity_gib", f"must hold one of the {role} pool's KV blocks "
              f"({need} bytes), got {config.kv_store.capacity_gib:g} GiB ({capacity} bytes)")
