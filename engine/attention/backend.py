"""Attention backends by name. The model calls store_kv then attention for each layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import reference
from engine.attention.blocked import DecodePlan, blocked_decode_attention, build_decode_plan
from engine.attention.metadata import AttentionMetadata


class AttentionBackend:
    """The torch reference, the oracle; faster backends subclass and override.

    The runner calls prepare() once per step (before the forward) so per-step work is
    not repeated in every layer. Every attention layer then calls, inside
    attention_context(), store_kv first (the new tokens' K/V must be visible to their
    own queries), then attention. Neither may synchronise with the host on a GPU.
    """

    name = "reference"

    def prepare(self, md: AttentionMetadata, block_size: int) -> None:
        pass

    def store_kv(self, layer_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 md: AttentionMetadata) -> None:
        """key, value: [T, H, D] of this step's tokens, written at md.slot_mapping."""
        reference.store_kv(layer_cache, key, value, md.slot_mapping)

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  layer_cache: torch.Tensor, md: AttentionMetadata, scale: float) -> torch.Tensor:
        """query [T, Hq, D]; key, value [T, H, D]: this step's tokens, already stored.

        Returns [T, Hq, D]. The reference reads all K/V back from the cache.
        """
        return reference.paged_attention(query, layer_cache, md, scale)


@dataclass
class _StepState:
    decode: DecodePlan | None  # decode rows, if any
    keep: torch.Tensor  # [T'] int64, tokens whose K/V are stored (slot != -1)
    blocks: torch.Tensor  # [T'] int64, their block ids
    offsets: torch.Tensor  # [T'] int64, their offsets within the block


class TorchBackend(AttentionBackend):
    """Plain torch, fast on CPU. Decode rows go through the blocked segmented softmax
    (attention/blocked.py); a prompt with no cached context attends over its fresh K/V
    directly; a chunk over a cached context gathers that context from the cache."""

    name = "torch"

    def prepare(self, md: AttentionMetadata, block_size: int) -> None:
        decode_rows = [i for i, q in enumerate(md.query_lens_cpu) if q == 1]
        plan = build_decode_plan(md, block_size, decode_rows) if decode_rows else None
        # Padding slots (-1) are dropped once here rather than checked in every layer.
        keep = (md.slot_mapping >= 0).nonzero().flatten()
        slots = md.slot_mapping[keep]
        md.backend_state = _StepState(plan, keep, slots // block_size, slots % block_size)

    def store_kv(self, layer_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 md: AttentionMetadata) -> None:
        state: _StepState = md.backend_state
        if state.keep.numel() != key.shape[0]:
            key, value = key[state.keep], value[state.keep]
        layer_cache[state.blocks, 0, state.offsets] = key
        layer_cache[state.blocks, 1, state.offsets] = value

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  layer_cache: torch.Tensor, md: AttentionMetadata, scale: float) -> torch.Tensor:
        plan = md.backend_state.decode
        if plan is not None and plan.num_rows == md.num_seqs:
            return blocked_decode_attention(query, layer_cache, plan, scale)
        out = torch.empty_like(query)
        if plan is not None:
            out[plan.rows] = blocked_decode_attention(query, layer_cache, plan, scale)
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(md.query_lens_cpu, md.seq_lens_cpu)):
            end = start + q_len
            if q_len == 1:
                pass  # a decode row: computed by the blocked path above
            elif q_len == seq_len:
                out[start:end] = reference.causal_attention(query[start:end], key[start:end],
                                                            value[start:end], scale)
            else:
                k, v = reference.gather_kv(layer_cache, md.block_tables[i], seq_len)
                out[start:end] = reference.causal_attention(query[start:end], k, v, scale)
            start = end
        return out


BACKENDS: dict[str, type[AttentionBackend]] = {"reference": AttentionBackend, "torch": TorchBackend}


def get_backend(name: str, device: str) -> AttentionBackend:
    """'auto': Triton kernels on CUDA once registered, else plain torch."""
    if name == "auto":
        name = "triton" if device.startswith("cuda") and "triton" in BACKENDS else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(BACKENDS)}")
    return BACKENDS[name]()
