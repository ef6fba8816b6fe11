"""Input checks and launch settings shared by the kernel launchers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# An fp8 cache (engine/attention/kv_quant.py): loaded and widened to the query's dtype.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_layer_cache(layer_cache: torch.Tensor) -> tuple[int, int, int]:
    """One layer's view of the block-major cache, [num_blocks, 2, block_size, H, D].

    Returns (block_size, kv_heads, head_dim)."""
    if layer_cache.dim() != 5 or layer_cache.shape[1] != 2:
        raise ValueError(f"layer cache must be [num_blocks, 2, block_size, kv_heads, head_dim], "
                         f"got {tuple(layer_cache.shape)}")
    if layer_cache.dtype not in SUPPORTED_DTYPES + FP8_DTYPES:
        raise ValueError(f"unsupported KV cache dtype {layer_cache.dtype}")
    if layer_cache.stride(-1) != 1:
        raise ValueError(f"layer cache head_dim must be contiguous, strides {layer_cache.stride()}")
    _, _, block_size, num_kv_heads, head_dim = layer_cache.shape
    if head_dim != next_power_of_2(head_dim) or head_dim < 16:
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    return block_size, num_kv_heads, head_dim


def check_tokens(name: str, t: torch.Tensor, num_heads: int, head_dim: int, device: torch.device,
                 dtype: torch.dtype | None = None) -> None:
    """A [T, heads, head_dim] tensor with a contiguous last dimension."""
    if t.dim() != 3 or tuple(t.shape[1:]) != (num_heads, head_dim):
        raise ValueError(f"{name} must be [tokens, {num_heads}, {head_dim}], got {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} head_dim must be contiguous, strides {t.stride()}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the KV cache on {device}")
    if dtype is not None and t.dtype != dtype and not (dtype in FP8_DTYPES and t.dtype in SUPPORTED_DTYPES):
        raise ValueError(f"{name} is {t.dtype}, the KV cache {dtype}")


def check_attention_io(out: torch.Tensor, query: torch.Tensor,
                       layer_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """An attention launcher's cache, query and output; returns (block_size, kv_heads,
    head_dim, query_heads)."""
    block_size, num_kv_heads, head_dim = check_layer_cache(layer_cache)
    num_q_heads = query.shape[1] if query.dim() == 3 else -1
    if num_q_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"query heads {tuple(query.shape)} must be a multiple of the cache's "
                         f"{num_kv_heads} KV heads")
    check_tokens("query", query, num_q_heads, head_dim, layer_cache.device)
    check_tokens("out", out, num_q_heads, head_dim, layer_cache.device)
    if query.dtype not in SUPPORTED_DTYPES or (query.dtype != layer_cache.dtype and layer_cache.dtype not in FP8_DTYPES):
        raise ValueError(f"query is {query.dtype}, the KV cache {layer_cache.dtype}: they must match, "
                         "unless the cache is fp8")
    return block_size, num_kv_heads, head_dim, num_q_heads


def check_index(name: str, t: torch.Tensor, dims: int, dtype: torch.dtype, device: torch.device,
                rows: int | None = None) -> None:
    if t.dim() != dims or t.dtype != dtype or t.device != device or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dims}-D {dtype} tensor on {device}, "
                         f"got {t.dim()}-D {t.dtype} on {t.device}")
    if rows is not None and t.shape[0] != rows:
        raise ValueError(f"{name} has {t.shape[0]} rows, expected {rows}")


# A layer without a sliding window attends as if its window were this wide: wider than
# any context, and small enough that position - window stays within int32.
NO_WINDOW = 1 << 30


def kernel_window(window: int) -> int:
    """The window the attention kernels take: `window` (> 0), or NO_WINDOW for none."""
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: none), got {window}")
    return window if window > 0 else NO_WINDOW


def check_softcap(softcap: float) -> float:
    if not softcap >= 0.0:  # NaN too
        raise ValueError(f"softcap must be >= 0 (0: none), got {softcap}")
    return float(softcap)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs need IEEE dots to stay exact; 16-bit values are exact in tf32, so
    their products cost nothing in precision on tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def native_dots(cache: torch.Tensor, query: torch.Tensor) -> bool:
    """Whether the attention kernels multiply 16-bit K/V as they are (fp32 accumulate,
    as flash-attention does) rather than widening them to fp32 first. On a GPU that
    halves the registers a tile takes and runs on the 16-bit tensor cores; the Triton
    interpreter (numpy, on CPU) has no bf16 matmul, so there they are widened. An fp8
    cache under a 16-bit query is widened to the query's dtype (exactly) as it loads."""
    return cache.is_cuda and query.dtype in (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and Triton launch options of one attention kernel.

    Results depend on block_n (the order in which keys are summed) but never on the
    split count, so eager steps and CUDA graphs, which share a config, agree bit for bit.
    """

    block_n: int  # keys per inner iteration; >= 16 (tl.dot)
    block_m: int = 16  # query rows per program (prefill; a decode program's rows are its query heads)
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_n", "block_m"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"bad launch options: num_warps={self.num_warps}, num_stages={self.num_stages}")
