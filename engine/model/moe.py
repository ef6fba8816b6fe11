"""The sparse MLP of a mixture-of-experts model (Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V2/V3).

A router picks each token's top-k experts (softmax over every expert's logit, in
float32, the k largest, renormalised where the model says; DeepSeek's variants in
route()); the tokens are sorted by
expert and each expert runs once over all of its tokens (two GEMMs), its output scaled
by the token's routing weight and added into the token's row. A token's k expert
outputs are added in ascending expert order, as transformers adds them, so float32
results match it. Qwen2-MoE adds an always-on shared expert scaled by a sigmoid gate,
DeepSeek its shared experts (one MLP n_shared_experts wide) ungated.

Tensor parallel (engine/distributed/sharding.py): every expert's intermediate dimension
is split over the ranks like a dense MLP's (gate_up column-parallel, down row-parallel),
the shared expert's too, and the router is replicated; one all-reduce sums the ranks'
partial outputs, experts and shared expert together.

On CUDA the experts run as engine/kernels/fused_moe.py's two grouped GEMMs over the
tokens sorted by expert instead (tests/unit/test_mla_moe_kernels.py compares them).

Expert parallel (enable_expert_parallel): each rank holds E / N whole experts instead.
Attention stays tensor-parallel, so after its all-reduce every rank already holds every
token's hidden state: dispatch needs no all-to-all (each rank routes all tokens, the
router being replicated, and runs its own experts over those routed to them), and the
combine is the all-reduce the layer makes anyway, of the ranks' partial sums. An
all-to-all would pay only with data-parallel attention, where ranks hold different tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.group import Group
from engine.distributed.sharding import Shard
from engine.model.config import DEEPSEEK, ModelConfig


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up fused into one matmul, without a
    collective (its caller reduces)."""

    def __init__(self, hidden_size: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor] = silu_mul) -> torch.Tensor:
        return self.down_proj(act(self.gate_up_proj(x)))


class Experts(nn.Module):
    """The rank's experts' weights stacked, experts [first, first + E): w13 [E, 2 * I, H]
    (gate rows, then up rows), w2 [E, H, I], I the rank's part of an expert's
    intermediate dimension. A token routed to another rank's expert gets nothing here."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate: int, first: int = 0) -> None:
        super().__init__()
        self.first = first
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate))

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                act: Callable[[torch.Tensor], torch.Tensor] = silu_mul) -> torch.Tensor:
        """x [T, H]; experts, weights [T, k]: the tokens' experts and routing weights."""
        if x.is_cuda:  # the fused Triton kernels (SiLU-and-mul their own), no host sync
            from engine.kernels.fused_moe import fused_moe

            return fused_moe(x, self.w13, self.w2, experts, weights, self.first)
        top_k = experts.shape[1]
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # (token, k) slots grouped by expert, ascending
        end = self.first + self.w13.shape[0]
        counts = torch.bincount(flat, minlength=end).tolist()
        slot_weights = weights.flatten()
        out = torch.zeros_like(x)
        start = sum(counts[:self.first])  # the slots of experts before the rank's
        for expert in range(self.first, end):
            n = counts[expert]
            if not n:
                continue
            slots = order[start:start + n]
            start += n
            tokens = slots // top_k
            local = expert - self.first
            h = F.linear(act(F.linear(x[tokens], self.w13[local])), self.w2[local])
            out.index_add_(0, tokens, (h * slot_weights[slots, None]).to(out.dtype))
        return out


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard, group: Group) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None, "a SparseMoE needs the model's MoEConfig"
        self.moe, self.group = moe, group
        self.fp32_router = cfg.architecture in DEEPSEEK  # its router's matmul in float32, the others' in x's dtype
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)
        # DeepSeek-V3's correction bias (a parameter so the loader fills it).
        self.e_score_correction_bias = nn.Parameter(torch.empty(moe.num_experts)) if moe.scoring == "sigmoid" \
            else None
        self.experts = Experts(shard.num_experts, cfg.hidden_size, shard.expert_intermediate_size, shard.experts[0])
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if moe.shared_intermediate_size:
            self.shared_expert = GatedMLP(cfg.hidden_size, shard.shared_intermediate_size)
        if moe.shared_gate:
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k (experts [T, k] int64, weights [T, k] in x's dtype, DeepSeek's float32)."""
        moe = self.moe
        if self.fp32_router and x.dtype != torch.float32:
            logits = F.linear(x.float(), self.gate.weight.float())
        else:
            logits = self.gate(x).float()  # (on CPU in float32 the gate may be a packed linear: no .weight)
        scores = logits.sigmoid() if moe.scoring == "sigmoid" else logits.softmax(dim=-1)
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias.float()
        if moe.grouped:
            groups = choice.view(-1, moe.n_group, moe.num_experts // moe.n_group)
            # A group's score: its best expert's, or (sigmoid scoring) its best two summed.
            best = groups.topk(2, dim=-1)[0].sum(-1) if moe.scoring == "sigmoid" else groups.max(dim=-1).values
            kept = torch.zeros_like(best).scatter_(1, best.topk(moe.topk_group, dim=-1)[1], 1.0).bool()
            masked = 0.0 if self.e_score_correction_bias is None else float("-inf")
            choice = groups.masked_fill(~kept[..., None], masked).flatten(1)
        experts = choice.topk(moe.top_k, dim=-1)[1]
        weights = scores.gather(1, experts)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if moe.scoring == "sigmoid" else 0.0))
        weights = weights * moe.routed_scaling_factor
        # DeepSeek's weights stay float32 (each expert's output rounds once, after them), as in transformers.
        return experts, weights if self.fp32_router else weights.to(x.dtype)

    def forward(self, x: torch.Tensor, silu_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None
                ) -> torch.Tensor:
        act = silu_and_mul or silu_mul
        experts, weights = self.route(x)
        out = self.experts(x, experts, weights, act)
        if self.shared_expert is not None:
            shared = self.shared_expert(x, act)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return self.group.all_reduce_(out)
