"""A PEFT adapter directory's files, read and checked without torch: what the engine
reads before it loads the tensors (engine/lora/adapter.py), and all the router reads
(router/adapters.py): the config's checks, the largest rank it declares, and the
prefix-cache root of that read of the files, which both must compute alike (the
router's kv_aware index hashes a prompt's blocks as the engines do).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import xxhash

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


def read_files(name: str, path: str | Path) -> tuple[dict[str, Any], bytes, int]:
    """(its checked adapter_config.json, the weights file's bytes, the digest of both
    files' bytes); ValueError naming what is missing or wrong."""
    root = Path(path)
    if not (root / CONFIG_FILE).is_file() or not (root / WEIGHTS_FILE).is_file():
        raise ValueError(f"LoRA adapter {name!r}: {root} needs {CONFIG_FILE} and {WEIGHTS_FILE} (PEFT's format)")
    try:
        raw_config, raw_weights = (root / CONFIG_FILE).read_bytes(), (root / WEIGHTS_FILE).read_bytes()
    except OSError as exc:
        raise ValueError(f"LoRA adapter {name!r}: cannot read {root}: {exc}") from None
    try:
        config = json.loads(raw_config)
    except ValueError as exc:
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not JSON: {exc}") from None
    check_config(name, config)
    return config, raw_weights, xxhash.xxh3_64_intdigest(raw_config + raw_weights)


def cache_root(name: str, digest: int) -> int:
    """The parent hash of a prompt's first KV block under the adapter `name` whose files
    have this digest: its blocks' hashes chain from it, so no other adapter, no other
    read of other files under this name, nor the base model (root 0) ever hits them."""
    return xxhash.xxh3_64_intdigest(f"lora\0{name}\0{digest}".encode()) or 1


def declared_rank(config: dict[str, Any]) -> int:
    """The largest rank the config gives any module (r, or a rank_pattern value)."""
    return int(max([config["r"], *(config.get("rank_pattern") or {}).values()]))


def check_config(name: str, config: Any) -> None:
    """ValueError naming what pdserve cannot serve, or a malformed field."""
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} must hold an object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {config.get('peft_type')!r} is not LORA")
    refusals = [("use_dora", "DoRA"), ("modules_to_save", "modules_to_save"), ("fan_in_fan_out", "fan_in_fan_out"),
                ("layer_replication", "layer_replication"), ("lora_bias", "lora_bias"),
                ("target_parameters", "target_parameters"), ("trainable_token_indices", "trainable_token_indices"),
                ("alora_invocation_tokens", "aLoRA")]
    for key, what in refusals:
        if config.get(key):
            raise ValueError(f"LoRA adapter {name!r}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: bias {config['bias']!r} is not supported (only 'none')")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"LoRA adapter {name!r}: {key} must be a positive number, got {value!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        patterns = config.get(key) or {}
        if not isinstance(patterns, dict) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in patterns.values()):
            raise ValueError(f"LoRA adapter {name!r}: {key} must map module patterns to positive numbers")
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"LoRA adapter {name!r}: {key} key {pattern!r} is not a regex: {exc}") from None
