"""A PEFT adapter directory's files, read and checked without torch: what the engine
reads before it loads the tensors (engine/lora/adapter.py), and all the router and the
config read (router/adapters.py, cluster/lora_config.py: check_adapter): the config's
checks, the tensors' names and shapes against the model (from the safetensors header),
and the digest of that read of the files, from which the prefix-cache root follows,
which router and workers must compute alike (the router's kv_aware index hashes a
prompt's blocks as the engines do; a worker refuses a request whose adapter's files
are not the ones the router read).
"""

from __future__ import annotations

import json
import re
import struct
import unicodedata
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xxhash

from engine.model.config import ModelConfig

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


class AdapterError(ValueError):
    """A request's adapter cannot serve it (its files unreadable, changed, unfit): the
    request is refused naming its `model` parameter, which named the adapter."""

    param = "model"


# PEFT's name for a projection -> the engine's module and which part of it.
PARTS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
         "down_proj": ("down_proj", 0), "qkv_proj": ("qkv_proj", None), "gate_up_proj": ("gate_up_proj", None)}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on its JSON header


def part_sizes(cfg: ModelConfig, module: str) -> tuple[list[int], int]:
    """(output rows of each part, input width) of one layer's projection, unsharded."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv_proj": ([q, kv, kv], cfg.hidden_size), "o_proj": ([cfg.hidden_size], q),
            "gate_up_proj": ([cfg.intermediate_size] * 2, cfg.hidden_size),
            "down_proj": ([cfg.hidden_size], cfg.intermediate_size)}[module]


def max_parts(module: str) -> int:
    """How many PEFT projections one engine module fuses: its rank budget's multiple."""
    return {"qkv_proj": 3, "gate_up_proj": 2}.get(module, 1)


def read_files(name: str, path: str | Path) -> tuple[dict[str, Any], bytes, int]:
    """(its checked adapter_config.json, the weights file's bytes, the digest of both
    files' bytes); ValueError naming what is missing or wrong."""
    root = Path(path)
    # Any failure to read is the adapter's (ValueError: its request, or its load, is
    # refused), never the reader's: a worker must not go down for an unreadable file.
    try:
        if not (root / CONFIG_FILE).is_file() or not (root / WEIGHTS_FILE).is_file():
            raise ValueError(f"LoRA adapter {name!r}: {root} needs {CONFIG_FILE} and {WEIGHTS_FILE} (PEFT's format)")
        raw_config, raw_weights = (root / CONFIG_FILE).read_bytes(), (root / WEIGHTS_FILE).read_bytes()
    except OSError as exc:
        raise ValueError(f"LoRA adapter {name!r}: cannot read {root}: {exc.strerror or exc}") from None
    try:
        config = json.loads(raw_config)
    except RecursionError:
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} is nested too deeply") from None
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


def check_adapter(name: str, path: str | Path, cfg: ModelConfig, max_rank: int) -> int:
    """Everything about an adapter that can be checked without loading its tensors:
    its config, and its tensors' names and shapes (from the safetensors header) against
    the model `cfg` and max_rank; ValueError naming the problem. Its files' digest."""
    config, raw_weights, digest = read_files(name, path)
    shapes = header_shapes(name, raw_weights)
    pairs = check_tensors(name, shapes, cfg, max_rank)
    check_declared(name, config, {at: shapes[key_a][0] for at, (key_a, _) in pairs.items()})
    if declared_rank(config) > max_rank:
        raise ValueError(f"LoRA adapter {name!r} has rank {declared_rank(config)}, above max_lora_rank {max_rank}")
    return digest


def header_shapes(name: str, raw: bytes) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape as a safetensors file's header gives it (its data within the file)."""
    bad = f"LoRA adapter {name!r}: {WEIGHTS_FILE} cannot be read"
    if len(raw) < 8:
        raise ValueError(f"{bad}: {len(raw)} bytes")
    (size,) = struct.unpack("<Q", raw[:8])
    if size > min(MAX_HEADER_BYTES, len(raw) - 8):
        raise ValueError(f"{bad}: a header of {size} bytes in a file of {len(raw)}")
    try:
        header = json.loads(raw[8:8 + size])
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{bad}: its header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{bad}: its header is not an object")
    shapes = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if not (isinstance(entry, dict) and isinstance(entry.get("shape"), list)
                and all(isinstance(d, int) and d >= 0 for d in entry["shape"])
                and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2
                and all(isinstance(o, int) for o in entry["data_offsets"])
                and 0 <= entry["data_offsets"][0] <= entry["data_offsets"][1] <= len(raw) - 8 - size):
            raise ValueError(f"{bad}: tensor {key!r} has no shape and offsets within the file")
        shapes[key] = tuple(entry["shape"])
    return shapes


def check_tensors(name: str, shapes: Mapping[str, tuple[int, ...]], cfg: ModelConfig,
                  max_rank: int) -> dict[tuple[int, str], tuple[str, str]]:
    """The adapter's tensors, by name and shape, checked against the model `cfg`: each a
    LoRA A or B of a decoder layer's attention or MLP projection, in pairs of [r, in]
    and [out, r] that fit it, r <= max_rank; ValueError naming the first that is not.
    (layer, PEFT projection) -> (its A's name, its B's name), in order."""
    prefix = f"LoRA adapter {name!r}"
    if cfg.mla is not None or cfg.moe is not None:
        raise ValueError(f"{prefix}: adapters on mixture-of-experts and latent-attention models are not supported")
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for key in shapes:
        m = _KEY.match(key)
        if m is None or m.group(3) not in PARTS:
            raise ValueError(f"{prefix}: tensor {key!r} is not a LoRA A/B of a decoder layer's attention or MLP "
                             f"projection ({', '.join(PARTS)})")
        layer = int(m.group(1))
        if layer >= cfg.num_layers:
            raise ValueError(f"{prefix}: tensor {key!r} is for layer {layer}; the model has {cfg.num_layers}")
        pairs.setdefault((layer, m.group(3)), {})[m.group(4)] = key
    out = {}
    for (layer, proj), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{prefix}: layer {layer} {proj} has lora_{''.join(ab)} without its pair")
        a, b = shapes[ab["A"]], shapes[ab["B"]]
        if len(a) != 2 or len(b) != 2 or b[1] != a[0]:
            raise ValueError(f"{prefix}: layer {layer} {proj}: lora_A {a} and lora_B {b} are not [r, in] and [out, r]")
        if a[0] > max_rank:
            raise ValueError(f"{prefix}: layer {layer} {proj} has rank {a[0]}, above max_lora_rank {max_rank}")
        module, part = PARTS[proj]
        sizes, width = part_sizes(cfg, module)
        rows = sum(sizes) if part is None else sizes[part]
        if a[1] != width or b[0] != rows:
            raise ValueError(f"{prefix}: layer {layer} {proj}: lora_A {a} and lora_B {b} do not fit the model's "
                             f"[{rows}, {width}] projection")
        out[(layer, proj)] = (ab["A"], ab["B"])
    fused = {(layer, PARTS[proj][0]) for layer, proj in out if PARTS[proj][1] is None}
    if any((layer, PARTS[proj][0]) in fused and PARTS[proj][1] is not None for layer, proj in out):
        raise ValueError(f"{prefix}: a fused projection has adapters of its parts too")
    if not out:
        raise ValueError(f"{prefix}: {WEIGHTS_FILE} holds no LoRA weights")
    return out


def module_name(proj: str, layer: int) -> str:
    """The projection's name in the base model, as PEFT matches its patterns against it."""
    owner = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj") else "mlp"
    return f"model.layers.{layer}.{owner}.{proj}"


def pattern_value(patterns: Any, proj: str, layer: int) -> Any:
    """A rank_pattern / alpha_pattern value for this projection, matched as PEFT does:
    the key against the end of the module's dotted name."""
    module = module_name(proj, layer)
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return None


def check_declared(name: str, config: dict[str, Any], ranks: Mapping[tuple[int, str], int]) -> None:
    """The tensors (each (layer, PEFT projection)'s rank) are what the config declares:
    each rank its r (or rank_pattern's), each projection one target_modules names (a
    list of names or suffixes, or a regex over the full name; "all-linear" any).
    PEFT refuses files that disagree with their config; so does pdserve, naming where."""
    targets = config.get("target_modules")
    for (layer, proj), rank in ranks.items():
        declared = pattern_value(config.get("rank_pattern"), proj, layer) or config["r"]
        if rank != declared:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {proj} has rank {rank}; {CONFIG_FILE} declares "
                             f"{declared}")
        full = module_name(proj, layer)
        if isinstance(targets, str):
            try:
                ok = targets == "all-linear" or re.fullmatch(targets, full) is not None
            except re.error as exc:
                raise ValueError(f"LoRA adapter {name!r}: target_modules {targets!r} is not a regex: {exc}") from None
        elif isinstance(targets, list):
            ok = any(isinstance(t, str) and (full == t or full.endswith(f".{t}")) for t in targets)
        else:
            ok = targets is None
        if not ok:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {proj} has weights, but {CONFIG_FILE}'s "
                             f"target_modules {targets!r} does not name it")


MAX_NAME_CHARS = 256


def name_problem(name: object) -> str | None:
    """What is wrong with an adapter's name (what requests give as `model`), or None: a
    string of 1 to MAX_NAME_CHARS characters, no control characters, no space at
    either end (a name a client could not send back, nor look up in /v1/models/{id})."""
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME_CHARS:
        return f"must be a name of 1 to {MAX_NAME_CHARS} characters, got {name!r}"
    if name != name.strip() or any(unicodedata.category(c) == "Cc" for c in name):
        return f"must have no control characters and no space at either end, got {name!r}"
    return None
