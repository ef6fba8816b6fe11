"""LoRA beside the served model, without workers: the config's `lora` section (set once
for both pools, each adapter checked as the file loads), the router's registry of
adapters (ids never reused, names never the model's), and routing that prefers a
worker holding the request's adapter and hashes its blocks from the adapter's root."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cluster.config import ClusterConfig, ConfigError
from engine.kv_cache.block_hash import hash_full_blocks
from engine.lora.files import cache_root, check_adapter, read_files
from engine.model.config import ModelConfig
from router.adapters import Adapters
from router.model_names import ServedModels
from router.routing import LORA_LOAD_TOKENS, RoutingPolicy


def config(model: Path, lora: object, **pool: object) -> ClusterConfig:
    return ClusterConfig.from_dict({"model": str(model), "lora": lora, "prefill": {"replicas": 1},
                                    "decode": {"replicas": 1, "engine": pool}})


def test_the_lora_section_sets_both_pools(lora_models: dict[str, Path]) -> None:
    out = config(lora_models["base"], {"adapters": {"a1": str(lora_models["a1"])}, "max_loras": 2,
                                       "max_lora_rank": 8, "max_cpu_loras": 3})
    for role in ("prefill", "decode"):
        engine = out.engine_config(role)
        assert (engine.enable_lora, engine.max_loras, engine.max_lora_rank, engine.max_cpu_loras) == (True, 2, 8, 3)
    assert not ClusterConfig.from_dict({"model": str(lora_models["base"])}).engine_config("decode").enable_lora


@pytest.mark.parametrize("lora,pool,message", [
    ({}, {"enable_lora": True}, "decode.engine.enable_lora: is set once, for both pools, in the lora section"),
    ({}, {"max_loras": 2}, "decode.engine.max_loras: is set once"),
    ({"adapters": {"a3": "A3"}, "max_lora_rank": 8}, {}, "rank 16, above lora.max_lora_rank 8"),
    ({"adapters": {"x": "/nonexistent/adapter"}}, {}, "lora.adapters.x: LoRA adapter 'x': /nonexistent/adapter needs"),
    ({"adapters": {"BASE": "A1"}}, {}, "is a name of the model itself"),
    ({"max_loras": 4, "max_cpu_loras": 2}, {}, "lora.max_cpu_loras: must be >= 4, got 2"),
    ({"max_lora_rank": 0}, {}, "lora.max_lora_rank: must be >= 1"),
    ({"adapters": ["a1"]}, {}, "lora.adapters"),
    ({"slots": 2}, {}, "lora.slots: unknown key"),
    ({}, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
     "enable_lora is not supported with speculative_config"),
])
def test_the_lora_section_refuses_by_path(lora_models: dict[str, Path], lora: dict, pool: dict,
                                          message: str) -> None:
    spell = {"A1": str(lora_models["a1"]), "A3": str(lora_models["a3"]), "BASE": lora_models["base"].name}
    if "adapters" in lora and isinstance(lora["adapters"], dict):
        lora = {**lora, "adapters": {spell.get(k, k): spell.get(v, v) for k, v in lora["adapters"].items()}}
    with pytest.raises(ConfigError) as err:
        config(lora_models["base"], lora, **pool)
    assert message in str(err.value)


def test_the_registry_assigns_ids_once_and_keeps_the_model_names(lora_models: dict[str, Path]) -> None:
    models = ServedModels.of(None, str(lora_models["base"]), 512, 16, {"a1": str(lora_models["a1"])})
    a1 = models.check({"model": "a1"})
    assert a1 is not None and a1.id == 1 and models.check({"model": lora_models["base"].name}) is None
    _, _, digest = read_files("a1", lora_models["a1"])
    assert a1.root == cache_root("a1", digest) != 0
    registry = models.adapters
    assert registry.load("a2", str(lora_models["a2"])).id == 2
    registry.unload("a2")
    assert registry.load("a2", str(lora_models["a2"])).id == 3  # a name loaded again is another adapter
    with pytest.raises(ValueError, match="already loaded"):
        registry.load("a1", str(lora_models["a2"]))
    assert registry.load("a1", str(lora_models["a3"]), replace=True).root != a1.root  # other files, other root
    with pytest.raises(ValueError, match="base model's name"):
        registry.load(lora_models["base"].name, str(lora_models["a1"]))
    with pytest.raises(ValueError, match="LoRA is off"):
        Adapters(None, frozenset()).load("a1", str(lora_models["a1"]))
    with pytest.raises(ValueError, match="rank 16, above max_lora_rank 8"):
        Adapters(8, frozenset(), {}, ModelConfig.from_model_dir(lora_models["base"])).load("a3", str(lora_models["a3"]))
    listing = models.listing()["data"]
    assert [m["id"] for m in listing] == [str(lora_models["base"]), "a1", "a2"]
    assert all(m["parent"] == str(lora_models["base"]) for m in listing[1:]) and listing[0]["parent"] is None


def test_a_changed_file_is_another_root(lora_models: dict[str, Path], tmp_path: Path) -> None:
    copy = tmp_path / "a1"
    copy.mkdir()
    for f in lora_models["a1"].iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    same = read_files("a1", copy)[2] == read_files("a1", lora_models["a1"])[2]
    cfg = json.loads((copy / "adapter_config.json").read_text())
    (copy / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": cfg["lora_alpha"] * 2}))
    assert same and read_files("a1", copy)[2] != read_files("a1", lora_models["a1"])[2]


def test_routing_prefers_a_worker_holding_the_adapter() -> None:
    prompt = list(range(2, 66))  # four full blocks of 16
    for policy in ("kv_aware", "least_loaded"):
        routing = RoutingPolicy(policy, 16, 1024, ["d0", "d1"])
        assert routing.rank(prompt, {"d0": 0, "d1": 0}, 77, {"d1"}).workers[0][0] == "d1"
        assert routing.rank(prompt, {"d0": 0, "d1": 0}).workers[0][0] == "d0"
    routing = RoutingPolicy("kv_aware", 16, 1024, ["d0", "d1"])
    # The adapter's blocks hash from its root: the base model's cached prompt is no hit.
    routing.indexes["d0"].add(hash_full_blocks(prompt[:-1], 16))
    ranked = routing.rank(prompt, {"d0": 0, "d1": 0}, 77, {"d1"})
    assert ranked.workers == [("d1", 0), ("d0", 0)] and ranked.hashes == hash_full_blocks(prompt[:-1], 16, root=77)
    # d0 holds the adapter's first three blocks: 48 tokens saved, less than reading the adapter.
    routing.indexes["d0"].add(ranked.hashes)
    assert 48 < LORA_LOAD_TOKENS and routing.rank(prompt, {"d0": 0, "d1": 0}, 77, {"d1"}).workers[0] == ("d1", 0)
    long = list(range(2, 258))  # 256 tokens: 240 cached on d0 outweigh the read
    routing.indexes["d0"].add(hash_full_blocks(long[:-1], 16, root=77))
    assert routing.rank(long, {"d0": 0, "d1": 0}, 77, {"d1"}).workers[0] == ("d0", 240)


def copy_adapter(source: Path, out: Path, config: dict | None = None, weights: bytes | None = None) -> Path:
    out.mkdir()
    cfg = json.loads((source / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**cfg, **(config or {})}))
    (out / "adapter_model.safetensors").write_bytes(
        weights if weights is not None else (source / "adapter_model.safetensors").read_bytes())
    return out


def test_what_no_worker_could_serve_is_refused_at_load(lora_models: dict[str, Path], tmp_path: Path) -> None:
    """The router reads the safetensors header: a torn file, or tensors of another
    model, are refused when loaded, not at every request naming them."""
    cfg = ModelConfig.from_model_dir(lora_models["base"])
    raw = (lora_models["a1"] / "adapter_model.safetensors").read_bytes()
    cases = {"torn": (raw[:len(raw) // 2], "no shape and offsets within the file"),
             "short": (raw[:5], "cannot be read: 5 bytes"),
             "header": (b"\xff" * 16, "a header of"),
             "other model": (None, "do not fit the model's")}
    for name, (weights, message) in cases.items():
        if weights is None:  # a1 for a model twice as wide
            wide = dataclasses.replace(cfg, hidden_size=cfg.hidden_size * 2)
            with pytest.raises(ValueError, match=message):
                check_adapter(name, lora_models["a1"], wide, 16)
            continue
        bad = copy_adapter(lora_models["a1"], tmp_path / name.replace(" ", "_"), weights=weights)
        with pytest.raises(ValueError, match=message):
            check_adapter(name, bad, cfg, 16)
    # Files that disagree with their config, which PEFT refuses too.
    for name, config, message in [("rank lie", {"r": 8}, "rank 4; adapter_config.json declares 8"),
                                  ("no target", {"target_modules": ["nonexistent_proj"]}, "does not name it"),
                                  ("bad regex", {"target_modules": "q_proj("}, "is not a regex")]:
        bad = copy_adapter(lora_models["a1"], tmp_path / name.replace(" ", "_"), config)
        with pytest.raises(ValueError, match=message):
            check_adapter(name, bad, cfg, 16)
    regex = copy_adapter(lora_models["a1"], tmp_path / "regex", {"target_modules": r".*\.(q_proj|v_proj)"})
    assert check_adapter("a1", lora_models["a1"], cfg, 16) == read_files("a1", lora_models["a1"])[2]
    check_adapter("regex", regex, cfg, 16)


def test_unreadable_files_are_the_adapters_fault_never_the_readers(lora_models: dict[str, Path],
                                                                   tmp_path: Path) -> None:
    """A worker must not go down for an adapter it cannot read: every failure is a
    ValueError (its request refused), not an OSError or RecursionError."""
    deep = copy_adapter(lora_models["a1"], tmp_path / "deep")
    (deep / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="nested too deeply"):
        read_files("deep", deep)
    with pytest.raises(ValueError, match="cannot read"):
        read_files("long", "x" * 5000)
    with pytest.raises(ValueError, match="needs adapter_config.json"):
        read_files("missing", tmp_path / "nothing")


@pytest.mark.parametrize("name", [" a1", "a1 ", "a\nb", "a\x00b", "", "x" * 257])
def test_adapter_names_a_client_could_not_send_back_are_refused(lora_models: dict[str, Path], name: str) -> None:
    registry = ServedModels.of(None, str(lora_models["base"]), 512, 16).adapters
    with pytest.raises(ValueError, match="lora_name must"):
        registry.load(name, str(lora_models["a1"]))
    with pytest.raises(ConfigError, match="lora.adapters: an adapter's name must"):
        config(lora_models["base"], {"adapters": {name: str(lora_models["a1"])}})
