"""Fused mixture-of-experts MLP: a sorted-token grouped GEMM, the GPU counterpart of
engine.model.moe.Experts.forward.

Experts.forward loops over the experts in Python, gathering each one's tokens and
running two GEMMs per expert: 2 * E launches, most tiny at decode. Here each of the
two GEMMs is one launch over all experts:

1. align_by_expert (host code, device tensors, no sync): the T * k (token, k) slots are
   sorted by expert and each expert's run is padded to a whole number of BLOCK_M rows,
   giving sorted slot ids (padding rows hold the sentinel T * k) and one expert id per
   BLOCK_M tile (-1 for the tiles past the last expert's run, whose count is only known
   on the device). Slots routed to experts outside [first, first + E) (another rank's,
   expert parallel) are left out, so they contribute nothing, as in Experts.forward.
2. _gate_up_kernel: per (tile, N block), gather the tile's tokens' rows of x and multiply
   by the tile's expert's gate and up rows of w13 (fp32 accumulate, tiled over K), then
   apply silu(gate) * up in the epilogue and write [padded slots, I]. Fusing the
   activation here saves a launch and the [padded slots, 2I] round trip through memory;
   its rounding follows the torch path (gate and up rounded to x's dtype, SiLU rounded,
   then the product).
3. _down_kernel: the same grouped GEMM with w2, scaled by each slot's routing weight,
   written to a float32 [T * k, H] buffer by slot id.
4. The k slots of each token are summed (float32) into out [T, H], in x's dtype.

Every weight tile a program loads serves all BLOCK_M slots of its tile, so an expert's
weights are read once per tile, not once per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.common import SUPPORTED_DTYPES, dot_precision, native_dots


@dataclass(frozen=True)
class MoEConfig:
    """Tile sizes and launch options of the two grouped GEMMs."""

    block_m: int = 16  # slots per tile (each expert's run is padded to a multiple)
    block_n: int = 64  # output columns per program
    block_k: int = 64  # reduction step
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):  # tl.dot needs each >= 16
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"bad launch options: num_warps={self.num_warps}, num_stages={self.num_stages}")


CPU_CONFIG = MoEConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)


def default_config(num_slots: int, num_experts: int, device: torch.device,
                   dtype: torch.dtype = torch.bfloat16) -> MoEConfig:
    """Untuned GPU guesses (no GPU run has timed them yet): tiles no taller than an
    expert's average run (decode pads a single slot to 16 rows), narrow N blocks while
    few tiles would leave SMs idle, one stage fewer for float32's twice-as-large tiles."""
    if device.type != "cuda":
        return CPU_CONFIG
    per_expert = num_slots / max(1, num_experts)
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64
    return MoEConfig(block_m=block_m, block_n=32 if block_m == 16 else 64, block_k=64, num_warps=4,
                     num_stages=2 if dtype == torch.float32 else 3)


def align_by_expert(experts: torch.Tensor, num_experts: int, first: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots (flattened [T, k] indices) grouped by local expert, each run padded to a
    multiple of block_m with the sentinel T * k, and the local expert of each block_m
    tile (-1: a tile past the last run). Sizes use the worst case (every expert's run
    one slot past a tile), so nothing waits on the device: CUDA-graph friendly.

    Returns (sorted_slots [tiles * block_m] int32, tile_experts [tiles] int32)."""
    flat = experts.flatten()
    num_slots = flat.numel()
    device = flat.device
    local = flat - first
    key = torch.where((local >= 0) & (local < num_experts), local, num_experts)  # E: not this rank's
    num_tiles = triton.cdiv(num_slots, block_m) + min(num_experts, num_slots)
    padded_total = num_tiles * block_m
    order = torch.argsort(key, stable=True)  # ascending expert, then slot (as Experts.forward)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    sorted_key = key[order]
    kept = sorted_key < num_experts
    e = sorted_key.clamp(max=num_experts - 1)
    # Sorted slot i of expert e goes to its padded run's start plus its rank in the run.
    rank = torch.arange(num_slots, device=device) - (counts.cumsum(0) - counts)[e]
    dest = torch.where(kept, padded_end[e] - padded[e] + rank, padded_total)  # others: a dump row
    sorted_slots = torch.full((padded_total + 1,), num_slots, dtype=torch.int32, device=device)
    sorted_slots.scatter_(0, dest, order.to(torch.int32))
    tile_start = torch.arange(num_tiles, device=device) * block_m
    tile_experts = torch.searchsorted(padded_end, tile_start, right=True)
    tile_experts = torch.where(tile_experts < num_experts, tile_experts, -1).to(torch.int32)
    return sorted_slots[:padded_total], tile_experts


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, act_ptr, sorted_slots_ptr, tile_experts_ptr, num_slots, hidden, inter,
                    stride_x, stride_we, stride_wn, stride_wk, stride_act,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, NATIVE: tl.constexpr):
    tile = tl.program_id(0)
    expert = tl.load(tile_experts_ptr + tile)
    if expert < 0:  # past the last expert's run
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + rows)
    row_ok = slots < num_slots  # padding rows hold the sentinel
    tokens = (slots // TOP_K).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    w = w_ptr + expert.to(tl.int64) * stride_we
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        a = tl.load(x_ptr + tokens[:, None] * stride_x + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        w_gate = tl.load(w + n[None, :] * stride_wn + k[:, None] * stride_wk, mask=w_mask, other=0.0)
        w_up = tl.load(w + (n + inter)[None, :] * stride_wn + k[:, None] * stride_wk, mask=w_mask, other=0.0)
        if not NATIVE:
            a = a.to(tl.float32)
            w_gate = w_gate.to(tl.float32)
            w_up = w_up.to(tl.float32)
        acc_gate = tl.dot(a, w_gate, acc=acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(a, w_up, acc=acc_up, input_precision=PRECISION)
    dtype = act_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    tl.store(act_ptr + rows[:, None].to(tl.int64) * stride_act + n[None, :], act.to(dtype),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, out_ptr, sorted_slots_ptr, tile_experts_ptr, weights_ptr, num_slots,
                 hidden, inter, stride_act, stride_we, stride_wn, stride_wk, stride_out,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr, NATIVE: tl.constexpr):
    tile = tl.program_id(0)
    expert = tl.load(tile_experts_ptr + tile)
    if expert < 0:
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + rows)
    row_ok = slots < num_slots
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    w = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < inter
        # Padding rows were never written: masked, never read.
        a = tl.load(act_ptr + rows[:, None].to(tl.int64) * stride_act + k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w + n[None, :] * stride_wn + k[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)
        if not NATIVE:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc=acc, input_precision=PRECISION)
    weight = tl.load(weights_ptr + slots, mask=row_ok, other=0.0).to(tl.float32)
    h = acc.to(act_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]  # the expert's output rounds first
    tl.store(out_ptr + slots[:, None].to(tl.int64) * stride_out + n[None, :], h,
             mask=row_ok[:, None] & n_ok[None, :])


def _check_inputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, experts: torch.Tensor,
                  weights: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [tokens, hidden] with contiguous rows, got {tuple(x.shape)} "
                         f"(strides {x.stride()})")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported x dtype {x.dtype}")
    tokens, hidden = x.shape
    if w13.dim() != 3 or w13.shape[2] != hidden or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [experts, 2 * intermediate, {hidden}], got {tuple(w13.shape)}")
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (num_experts, hidden, inter):
        raise ValueError(f"w2 must be [{num_experts}, {hidden}, {inter}] to match w13, got {tuple(w2.shape)}")
    for name, w in (("w13", w13), ("w2", w2)):
        if w.dtype != x.dtype or w.device != x.device:
            raise ValueError(f"{name} is {w.dtype} on {w.device}, x {x.dtype} on {x.device}")
    if experts.dim() != 2 or experts.shape[0] != tokens or experts.dtype != torch.int64:
        raise ValueError(f"experts must be [{tokens}, top_k] int64, got {tuple(experts.shape)} {experts.dtype}")
    if tuple(weights.shape) != tuple(experts.shape) or not weights.is_floating_point():
        raise ValueError(f"weights must be a float [{tokens}, top_k] like experts, got "
                         f"{tuple(weights.shape)} {weights.dtype}")
    for name, t in (("experts", experts), ("weights", weights)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    if experts.shape[1] < 1 or num_experts < 1:
        raise ValueError(f"need top_k >= 1 and at least one expert, got {tuple(experts.shape)} and {num_experts}")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, experts: torch.Tensor,
              weights: torch.Tensor, first: int = 0, config: MoEConfig | None = None) -> torch.Tensor:
    """out[t] = sum_k weights[t, k] * w2[e] @ (silu(gate) * up), [gate | up] = w13[e] @ x[t],
    e = experts[t, k] - first; slots whose expert is outside [first, first + E) add nothing.

    x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I], both x's dtype;
    experts [T, k] int64 global expert ids; weights [T, k]. Returns [T, H] in x's dtype.
    """
    _check_inputs(x, w13, w2, experts, weights)
    tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    top_k = experts.shape[1]
    num_slots = tokens * top_k
    if num_slots == 0:
        return torch.zeros_like(x)
    config = config or default_config(num_slots, num_experts, x.device, x.dtype)
    sorted_slots, tile_experts = align_by_expert(experts, num_experts, first, config.block_m)
    num_tiles = tile_experts.shape[0]
    common = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                  PRECISION=dot_precision(x.dtype), NATIVE=native_dots(x, x), num_warps=config.num_warps,
                  num_stages=config.num_stages)
    act = torch.empty((sorted_slots.shape[0], inter), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_tiles, triton.cdiv(inter, config.block_n))](
        x, w13, act, sorted_slots, tile_experts, num_slots, hidden, inter, x.stride(0), w13.stride(0),
        w13.stride(1), w13.stride(2), act.stride(0), TOP_K=top_k, **common)
    # Float32, zeroed: slots of other ranks' experts are never written and add nothing.
    slot_out = torch.zeros((num_slots, hidden), dtype=torch.float32, device=x.device)
    _down_kernel[(num_tiles, triton.cdiv(hidden, config.block_n))](
        act, w2, slot_out, sorted_slots, tile_experts, weights.reshape(-1), num_slots, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), slot_out.stride(0), **common)
    return slot_out.view(tokens, top_k, hidden).sum(1).to(x.dtype)


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, experts: torch.Tensor,
                        weights: torch.Tensor, first: int = 0) -> torch.Tensor:
    """The oracle: engine.model.moe.Experts.forward (a Python loop over the experts)
    with these weights, in x's dtype."""
    from engine.model.moe import Experts

    module = Experts(w13.shape[0], x.shape[1], w13.shape[1] // 2, first).to(device=x.device, dtype=x.dtype)
    with torch.no_grad():
        module.w13.copy_(w13)
        module.w2.copy_(w2)
        return module(x, experts, weights)
