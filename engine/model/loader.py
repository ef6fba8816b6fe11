"""Load a Hugging Face model directory (config.json + safetensors) into the engine model,
or with load_format "dummy" fill it with generated weights (dummy_weights.py) read
through the same code, so a rank's slice of a generated tensor is cut as a read one's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.attention.backend import AttentionBackend
from engine.config import LOAD_FORMATS
from engine.distributed.group import SINGLE, Group
from engine.distributed.sharding import Shard
from engine.model.config import ModelConfig
from engine.model.dummy_weights import DummyCheckpoint, checkpoint_shapes
from engine.model.fp8_linear import FP8, checkpoint_linears, quantize_linears
from engine.model.llama import LlamaForCausalLM
from engine.model.moe import SparseMoE

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# checkpoint name suffix -> (our parameter suffix, shard index within the fused tensor)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "shared_expert.gate_proj": ("shared_expert.gate_up_proj", 0),
    "shared_expert.up_proj": ("shared_expert.gate_up_proj", 1),
}
# Checkpoint tensors already fused as ours are (Phi-3's): each holds every piece.
_PREFUSED = re.compile(r"\.(self_attn\.qkv_proj|mlp\.gate_up_proj)\.")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^layers\.(\d+)\.")
# One expert's tensor (Mixtral's names, block_sparse_moe made mlp by _target, or Qwen-MoE's)
# -> a piece of the layer's stacked experts (engine/model/moe.py Experts): (our
# parameter, piece index in it).
_EXPERT = re.compile(r"^(layers\.\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$")
# An fp8 KV cache's per-layer scales (attention/kv_quant.py), under the names FP8
# checkpoints use: k_scale / v_scale; kv_scale for both; compressed-tensors' output
# scales of k_proj and v_proj.
_KV_SCALE = re.compile(r"^layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale|k_proj\.output_scale|"
                       r"v_proj\.output_scale)$")
_KV_SCALE_SIDES = {"k_scale": "k", "v_scale": "v", "kv_scale": "kv", "k_proj.output_scale": "k",
                   "v_proj.output_scale": "v"}
_EXPERT_PIECES = {"w1": ("w13", 0), "gate_proj": ("w13", 0), "w3": ("w13", 1), "up_proj": ("w13", 1),
                  "w2": ("w2", 0), "down_proj": ("w2", 0)}


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {str(model_dir)!r}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"safetensors shards listed in the index are missing: {missing}")
    return files


def _shard_sizes(param: str, cfg: ModelConfig, shard: Shard) -> list[int]:
    """Row sizes (this rank's) of the checkpoint tensors fused into `param` ([1 row
    block] if unfused); of one expert's, for stacked experts."""
    if ".qkv_proj." in param:
        q, kv = shard.num_q_heads * cfg.head_dim, shard.num_kv_heads * cfg.head_dim
        return [q, kv, kv]
    if param.endswith(".experts.w13"):
        return [shard.expert_intermediate_size] * 2
    if ".shared_expert.gate_up_proj." in param:
        return [shard.shared_intermediate_size] * 2
    if ".gate_up_proj." in param:
        return [shard.intermediate_size] * 2
    return [-1]


def _source_range(param: str, index: int, cfg: ModelConfig, shard: Shard) -> tuple[int, int, int, int] | None:
    """(dim, start, end, the dim's full size) of the checkpoint tensor this rank reads
    for `param` (shard `index` of a fused one); None: all of it."""
    if shard.size == 1:
        return None
    d, inter = cfg.head_dim, cfg.intermediate_size
    if cfg.mla is not None and ".self_attn." in param:
        return _mla_source_range(param, cfg, shard)
    if cfg.moe is not None and (".experts." in param or ".shared_expert." in param):
        expert = ".experts." in param
        rows = shard.expert_intermediate if expert else shard.shared_intermediate
        width = cfg.moe.intermediate_size if expert else cfg.moe.shared_intermediate_size
        return (0 if param.endswith((".w13", "gate_up_proj.weight")) else 1), *rows, width
    if ".qkv_proj." in param:
        heads, total = (shard.q_heads, cfg.num_heads) if index == 0 else (shard.kv_heads, cfg.num_kv_heads)
        return 0, heads[0] * d, heads[1] * d, total * d
    if ".gate_up_proj." in param:
        return 0, *shard.intermediate, inter
    if cfg.qk_norm == "projection" and param.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
        heads, total = (shard.q_heads, cfg.num_heads) if ".q_norm." in param else (shard.kv_heads, cfg.num_kv_heads)
        return 0, heads[0] * d, heads[1] * d, total * d  # the weights of the rank's heads
    if param.endswith("o_proj.weight"):
        return 1, shard.q_heads[0] * d, shard.q_heads[1] * d, cfg.num_heads * d
    if param.endswith("down_proj.weight"):
        return 1, *shard.intermediate, inter
    if param in ("embed_tokens.weight", "lm_head.weight"):
        return 0, shard.vocab[0], min(shard.vocab[1], shard.vocab_size), cfg.vocab_size
    return None


def _prefused_source_range(param: str, index: int, cfg: ModelConfig,
                           shard: Shard) -> tuple[int, int, int, int]:
    """(0, start, end, rows) of piece `index`'s rows this rank reads from a checkpoint
    tensor that is already fused (q | k | v or gate | up rows, each piece whole)."""
    full = _shard_sizes(param, cfg, Shard.of(cfg))
    offset = sum(full[:index])
    source = _source_range(param, index, cfg, shard) or (0, 0, full[index], full[index])
    assert source[0] == 0, f"{param}: fused pieces are stacked rows"
    return 0, offset + source[1], offset + source[2], sum(full)


def _mla_source_range(param: str, cfg: ModelConfig, shard: Shard) -> tuple[int, int, int, int] | None:
    """The rank's heads of MLA's per-head projections; the latent ones are replicated."""
    assert cfg.mla is not None
    m, (h0, h1) = cfg.mla, shard.q_heads
    rows = {".q_proj.weight": m.qk_head_dim, ".q_b_proj.weight": m.qk_head_dim,
            ".kv_b_proj.weight": m.qk_nope_head_dim + m.v_head_dim}
    for suffix, width in rows.items():
        if param.endswith(suffix):
            return 0, h0 * width, h1 * width, cfg.num_heads * width
    if param.endswith(".o_proj.weight"):
        return 1, h0 * m.v_head_dim, h1 * m.v_head_dim, cfg.num_heads * m.v_head_dim
    return None


def _read(f, name: str, dest: torch.Tensor, source: tuple[int, int, int, int] | None) -> torch.Tensor:
    """This rank's part of checkpoint tensor `name`, read alone (never the whole tensor
    when the rank holds a slice of it), its full shape checked against the config's."""
    if source is None:
        tensor = f.get_tensor(name)
        if tensor.shape != dest.shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dest.shape)} from config.json")
        return tensor
    dim, start, end, size = source
    part = f.get_slice(name)
    full = tuple(part.get_shape())
    expected = tuple(size if i == dim else n for i, n in enumerate(dest.shape))
    if full != expected:
        raise ValueError(f"tensor {name!r} has shape {full}, expected {expected} from config.json")
    return part[start:end] if dim == 0 else part[:, start:end]


def _target(name: str, cfg: ModelConfig) -> tuple[str, int | None, int | None]:
    """Map a checkpoint tensor name to (our parameter name, shard index in a fused
    tensor or None when the checkpoint's tensor is fused already and holds them all,
    the expert it is of stacked experts' or None)."""
    # Mixtral's router; DeepSeek's shared experts (one MLP) and its router's correction bias.
    name = (name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
            .replace(".mlp.shared_experts.", ".mlp.shared_expert.")
            .replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias"))
    expert = _EXPERT.match(name)
    if expert is not None and expert.group(3) in _EXPERT_PIECES:
        ours, piece = _EXPERT_PIECES[expert.group(3)]
        return f"{expert.group(1)}.mlp.experts.{ours}", piece, int(expert.group(2))
    for ckpt, (ours, shard) in _FUSED.items():
        if f".{ckpt}." in name and not (cfg.mla is not None and ckpt.startswith("self_attn.")):  # MLA: unfused
            return name.replace(ckpt, ours), shard, None
    if _PREFUSED.search(name) and cfg.mla is None:
        return name, None, None
    return name, 0, None


def _pieces(param: str, cfg: ModelConfig, shard: Shard) -> int:
    """How many checkpoint tensors fill `param`."""
    experts = shard.num_experts if ".experts." in param else 1
    return experts * len(_shard_sizes(param, cfg, shard))


def _expert_checkpoint_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Stacked experts' parameters split back into one checkpoint tensor per expert and
    piece (Qwen-MoE's names)."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        if name.endswith(".experts.w13"):
            for e in range(shape[0]):
                for piece in ("gate_proj", "up_proj"):
                    out[f"{name.removesuffix('w13')}{e}.{piece}.weight"] = (shape[1] // 2, shape[2])
        elif name.endswith(".experts.w2"):
            for e in range(shape[0]):
                out[f"{name.removesuffix('w2')}{e}.down_proj.weight"] = shape[1:]
        else:
            out[name] = shape
    return out


def _dummy_checkpoint(cfg: ModelConfig, backend: AttentionBackend, max_positions: int, device: str,
                      dtype: torch.dtype, seed: int) -> DummyCheckpoint:
    """Generated tensors named and shaped as the unsharded model's checkpoint."""
    full = Shard.of(cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, backend, max_positions, device, full)
    params = {name: tuple(p.shape) for name, p in model.named_parameters()}  # a tied lm_head once
    rows = {name: _shard_sizes(name, cfg, full) for name in params}
    return DummyCheckpoint(_expert_checkpoint_shapes(checkpoint_shapes(params, _FUSED, rows)), seed, dtype, device)


def load_model(model_dir: str | Path, cfg: ModelConfig, dtype: str, device: str,
               backend: AttentionBackend, max_positions: int, shard: Shard | None = None,
               group: Group = SINGLE, load_format: str = "safetensors", seed: int = 0,
               quantization: str | None = None) -> LlamaForCausalLM:
    """Build the model for `cfg` (this rank's part of it, for a tensor-parallel
    `shard`) and fill every parameter from the directory's safetensors, or with
    load_format "dummy" from tensors generated from `seed` on `device`. An FP8
    checkpoint's fp8 linears load as they are (fp8_linear.py); quantization "fp8"
    quantizes an unquantized checkpoint's at load, every rank together."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    shard = shard or Shard.of(cfg)
    path = Path(model_dir)
    torch_dtype = TORCH_DTYPES[dtype]
    # Build without initialising weights: every parameter is overwritten from the checkpoint.
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, backend, max_positions, device, shard, group)
    # model.to_empty(device), less its empty_like of meta tensors, which imports sympy
    # (torch's symbolic shapes): about 0.5 s of CPU in each process that builds a model.
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.to(torch_dtype)
    for module in model.modules():  # DeepSeek's router in float32 whatever the dtype, as transformers keeps it
        if isinstance(module, SparseMoE) and module.fp32_router:
            module.gate.float()
            if module.e_score_correction_bias is not None:
                module.e_score_correction_bias.data = module.e_score_correction_bias.data.float()
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # to_empty() unties shared parameters
    fp8_weights = set()
    if cfg.quantization == "fp8" and load_format != "dummy":
        fp8_weights = _fp8_weights(path, cfg)
        checkpoint_linears(model, fp8_weights)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: dict[str, set[tuple[int | None, int]]] = {name: set() for name in params}  # (expert, piece)
    if load_format == "dummy":
        dummy = _dummy_checkpoint(cfg, backend, max_positions, device, torch_dtype, seed)
        _fill(dummy, "generated weights", cfg, shard, params, loaded, model)
    else:
        for file in safetensors_files(path):
            with safe_open(file, framework="pt", device="cpu") as f:
                _fill(f, file.name, cfg, shard, params, loaded, model)
    if cfg.tie_word_embeddings:
        loaded["lm_head.weight"] = loaded["embed_tokens.weight"]
    missing = sorted(n for n, shards in loaded.items() if len(shards) < _pieces(n, cfg, shard))
    if missing:
        raise ValueError(f"checkpoint in {str(path)!r} is missing tensors for: {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}")
    if quantization == "fp8" and not fp8_weights:
        quantize_linears(model, group)
    model.eval()
    return model


def _fp8_weights(model_dir: Path, cfg: ModelConfig) -> set[str]:
    """Our parameter names of the checkpoint's float8 weights (a fused parameter is fp8
    if its pieces are; pieces of mixed types are refused)."""
    kinds: dict[str, set[bool]] = {}
    for file in safetensors_files(model_dir):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(".weight"):
                    ours = _target(name, cfg)[0]
                    kinds.setdefault(ours, set()).add(f.get_slice(name).get_dtype() == "F8_E4M3")
    mixed = sorted(n for n, k in kinds.items() if len(k) > 1)
    if mixed:
        raise ValueError(f"checkpoint in {str(model_dir)!r} mixes fp8 and other weights within {mixed[:4]}")
    return {n for n, k in kinds.items() if True in k}


def _fill_weight_scale(name: str, tensor: torch.Tensor, dest: torch.Tensor,
                      source: tuple[int, int, int, int] | None) -> None:
    """An fp8 weight's scale into its rows of the parameter's per-channel scales: one
    number (per tensor) for every row, or one per output channel, cut like the weight's
    rows when the rank holds a slice of them."""
    values = tensor.float().flatten()
    if not bool(torch.isfinite(values).all() and (values > 0).all()):
        raise ValueError(f"weight scale {name!r} must be positive and finite: a zero, negative or non-finite "
                         "scale would turn the weights into garbage")
    if values.numel() == 1:
        dest.fill_(values[0])
        return
    if source is not None and source[0] == 0:
        values = values[source[1]:source[2]]
    if values.shape != dest.shape:
        raise ValueError(f"weight scale {name!r} has {values.numel()} values for {dest.numel()} output channels: "
                         "per-tensor and per-channel scales only")
    dest.copy_(values)


def _set_kv_scale(f, name: str, match: re.Match[str], model: LlamaForCausalLM) -> None:
    """An fp8 cache's scale from the checkpoint, on its layer's attention (floats: read
    on the host every step, never synchronising with a device)."""
    layer = int(match.group(1))
    if layer >= model.config.num_layers:
        return  # DeepSeek-V3's multi-token prediction layers
    tensor = f.get_tensor(name)
    value = float(tensor.float().flatten()[0]) if tensor.numel() == 1 else float("nan")
    if not (value > 0 and value < float("inf")):
        raise ValueError(f"KV cache scale {name!r} must be one positive finite number, got {tensor.tolist()!r}")
    attn = model.layers[layer].self_attn
    for side in _KV_SCALE_SIDES[match.group(2)]:
        setattr(attn, f"{side}_scale", value)


_NO_QUANTIZATION_CONFIG = (
    "fp8 tensor {name!r} in {source} but the model's config.json has no quantization_config: an fp8 "
    "checkpoint names its format there (compressed-tensors float8, fbgemm_fp8 or fp8), which pdserve reads")


def _fill(f, source_name: str, cfg: ModelConfig, shard: Shard, params: dict[str, torch.nn.Parameter],
          loaded: dict[str, set[tuple[int | None, int]]], model: LlamaForCausalLM) -> None:
    """Copy this rank's part of every tensor in checkpoint `f` (a safetensors file, or
    a DummyCheckpoint) into params, recording in `loaded` which pieces arrived; KV
    cache scales go onto the model's attention layers."""
    for name in f.keys():
        if _IGNORED.search(name):
            continue
        kv_scale = _KV_SCALE.match(name.removeprefix("model."))
        if kv_scale is not None:
            _set_kv_scale(f, name, kv_scale, model)
            continue
        if name.endswith(".input_scale"):
            continue  # an FP8 checkpoint's static activation scale: activations are scaled per token instead
        ours, index, expert = _target(name, cfg)
        layer = _LAYER.match(ours)
        if cfg.mla is not None and layer is not None and int(layer.group(1)) >= cfg.num_layers:
            continue  # DeepSeek-V3's multi-token prediction layers, after the model's (unused, as in transformers)
        if ours.endswith(".weight_scale") and cfg.quantization is None:
            raise ValueError(_NO_QUANTIZATION_CONFIG.format(name=name, source=source_name))
        if ours not in params or (expert is not None and (cfg.moe is None or expert >= cfg.moe.num_experts)):
            raise ValueError(f"unexpected tensor {name!r} in {source_name}: not part of a "
                             f"{cfg.architecture} with this config")
        dest = params[ours].data
        if expert is not None:
            if not shard.experts[0] <= expert < shard.experts[1]:
                continue  # another rank's expert (expert parallel): not read here
            dest = dest[expert - shard.experts[0]]
        sizes = _shard_sizes(ours, cfg, shard)
        for i in range(len(sizes)) if index is None else [index]:
            piece = dest if sizes == [-1] else dest.narrow(0, sum(sizes[:i]), sizes[i])
            _fill_piece(f, name, source_name, ours, i, index is None, cfg, shard, piece)
            loaded[ours].add((expert, i))  # the expert's global index: each counted once


def _fill_piece(f, name: str, source_name: str, ours: str, index: int, prefused: bool, cfg: ModelConfig,
                shard: Shard, dest: torch.Tensor) -> None:
    """Copy this rank's rows of piece `index` of checkpoint tensor `name` (of all of it,
    unfused) into `dest`, its rows of parameter `ours`; from a tensor fused already,
    `prefused`, the piece's rows of it."""
    def source_range(param: str) -> tuple[int, int, int, int] | None:
        if prefused:
            return _prefused_source_range(param, index, cfg, shard)
        return _source_range(param, index, cfg, shard)

    if ours.endswith("o_proj.bias") and shard.rank > 0:
        dest.zero_()  # added once, by rank 0, before the all-reduce sums the ranks
    elif ours.endswith(".weight_scale"):
        _fill_weight_scale(name, f.get_tensor(name), dest, source_range(ours.removesuffix("_scale")))
    else:
        source = source_range(ours)
        tensor = _read(f, name, dest, source)
        if tensor.dtype == FP8 and dest.dtype != FP8:
            if cfg.quantization is None:
                raise ValueError(_NO_QUANTIZATION_CONFIG.format(name=name, source=source_name))
            raise ValueError(f"fp8 tensor {name!r} in {source_name}: pdserve has no fp8 path for it "
                             "(fp8 loads the decoder's attention and dense MLP linears; not experts)")
        if source is not None and dest.shape[source[0]] != tensor.shape[source[0]]:
            dest.zero_()  # the vocabulary's padding rows
            dest = dest.narrow(source[0], 0, tensor.shape[source[0]])
        dest.copy_(tensor)
