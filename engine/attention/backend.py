"""Attention backends by name. The model calls store_kv then attention for each layer."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.attention import cpu_decode, reference
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
                  layer_cache: torch.Tensor, md: AttentionMetadata, scale: float,
                  window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """query [T, Hq, D]; key, value [T, H, D]: this step's tokens, already stored.
        window > 0: a sliding-window layer, each query sees its last `window` positions
        (reference.window_start), and no backend reads a block wholly before them.
        softcap > 0: scores x become softcap * tanh(x / softcap) before the softmax.

        Returns [T, Hq, D]. The reference reads all K/V back from the cache.
        """
        return reference.paged_attention(query, layer_cache, md, scale, window, softcap)

    def latent_attention(self, query: torch.Tensor, latent: torch.Tensor, layer_cache: torch.Tensor,
                         md: AttentionMetadata, scale: float, kv_lora_rank: int) -> torch.Tensor:
        """Multi-head latent attention (engine/model/mla.py): query [T, Hq, D] absorbed,
        latent [T, 1, D] this step's [c, k_r], stored, then attended as key and as value
        (a one-plane cache's layer view reads it as both). Returns [T, Hq, kv_lora_rank]."""
        self.store_kv(layer_cache, latent, latent, md)
        return self.attention(query, latent, latent, layer_cache, md, scale)[..., :kv_lora_rank]


# Most tokens a speculative verify step has per sequence (its last token and at most 16
# drafts): attended as that many decode rows.
MAX_ROWS_PER_SEQUENCE = 17


@dataclass
class DecodeRowPlan:
    """Which tokens of a step attend as decode rows (one query token each)."""

    seq_ids: set[int]  # the sequences whose every token is a decode row
    table_rows: list[int]  # per row: its sequence (its block table's row)
    token_rows: list[int]  # per row: its token index in the flattened batch
    context_lens: list[int]  # per row: its context, its own token included


def plan_decode_rows(query_lens: list[int], seq_lens: list[int], num_drafts: list[int] | None = None
                     ) -> DecodeRowPlan:
    """Decode sequences, and sequences verifying drafts (speculative decoding: their
    last token and their drafts), as a decode row per token: the K/V of every token of
    the step is stored before attention, so row j of such a sequence attends over the
    context up to its own token. Prompt chunks keep the prompt path (a chunk after a
    prefix hit then computes as the same prompt without one)."""
    plan = DecodeRowPlan(set(), [], [], [])
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        if q_len == 1 or (num_drafts is not None and num_drafts[i] == q_len - 1 > 0):
            plan.seq_ids.add(i)
            plan.table_rows += [i] * q_len
            plan.token_rows += range(start, start + q_len)
            plan.context_lens += range(seq_len - q_len + 1, seq_len + 1)
        start += q_len
    return plan


@dataclass
class _DecodeRows:
    """This step's decode rows (one query token each), as the C kernel takes them. A
    sequence with a few tokens over a cached context gives a row per token, each over
    the context up to that token (its K/V is stored before attention runs)."""

    seq_ids: set[int]  # the sequences whose every token is a decode row
    token_rows: list[int]  # their token indices in the flattened batch
    context_lens: list[int]  # each row's context, its own token included
    rows: torch.Tensor  # [B] int64, token_rows on the device
    block_tables: torch.Tensor  # [B, max_blocks] int32, contiguous, one per row
    seq_lens: torch.Tensor  # [B] int32, context_lens on the device
    # For the blocked torch path, built on first use: one per window (0: none), as the
    # layers of a model may attend over windows of different widths.
    plans: dict[int, DecodePlan] = field(default_factory=dict)


@dataclass
class _StepState:
    decode: _DecodeRows | None  # decode rows, if any
    keep: torch.Tensor  # [T'] int64, tokens whose K/V are stored (slot != -1)
    blocks: torch.Tensor  # [T'] int64, their block ids
    offsets: torch.Tensor  # [T'] int64, their offsets within the block


class TorchBackend(AttentionBackend):
    """Fast on CPU. Decode rows go through the C kernel (attention/cpu_decode.py) for a
    float32 cache on CPU, else through the blocked segmented softmax in plain torch
    (attention/blocked.py); a prompt with no cached context attends over its fresh K/V
    directly; a chunk over a cached context gathers that context from the cache."""

    name = "torch"

    def prepare(self, md: AttentionMetadata, block_size: int) -> None:
        plan = plan_decode_rows(md.query_lens_cpu, md.seq_lens_cpu, md.num_drafts_cpu)
        decode = None
        if plan.seq_ids:
            device = md.seq_lens.device
            index = torch.tensor(plan.table_rows, device=device)
            decode = _DecodeRows(plan.seq_ids, plan.token_rows, plan.context_lens,
                                 torch.tensor(plan.token_rows, device=device),
                                 md.block_tables[index].contiguous(),
                                 torch.tensor(plan.context_lens, dtype=torch.int32, device=device))
        # Padding slots (-1) are dropped once here rather than checked in every layer.
        keep = (md.slot_mapping >= 0).nonzero().flatten()
        slots = md.slot_mapping[keep]
        md.backend_state = _StepState(decode, keep, slots // block_size, slots % block_size)

    @staticmethod
    def _decode(query: torch.Tensor, layer_cache: torch.Tensor, md: AttentionMetadata,
                scale: float, window: int, softcap: float) -> torch.Tensor:
        """[B, Hq, D] for the decode rows, in their batch order."""
        d: _DecodeRows = md.backend_state.decode
        if cpu_decode.supports(layer_cache, query.shape[1], query.dtype) and cpu_decode.load() is not None:
            return cpu_decode.paged_decode_attention(query, layer_cache, d.rows, d.block_tables,
                                                     d.seq_lens, scale, window, softcap)
        plan = d.plans.get(window)
        if plan is None:
            plan = d.plans[window] = build_decode_plan(d.token_rows, d.block_tables, d.context_lens,
                                                       layer_cache.shape[2], window)
        return blocked_decode_attention(query, layer_cache, plan, scale, softcap)

    def store_kv(self, layer_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 md: AttentionMetadata) -> None:
        state: _StepState = md.backend_state
        if state.keep.numel() != key.shape[0]:
            key, value = key[state.keep], value[state.keep]
        layer_cache[state.blocks, 0, state.offsets] = key.to(layer_cache.dtype)  # fp8: already on its grid
        layer_cache[state.blocks, 1, state.offsets] = value.to(layer_cache.dtype)

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  layer_cache: torch.Tensor, md: AttentionMetadata, scale: float,
                  window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        decode = md.backend_state.decode
        if decode is not None and len(decode.seq_ids) == md.num_seqs:
            return self._decode(query, layer_cache, md, scale, window, softcap)
        out = torch.empty_like(query)
        if decode is not None:
            out[decode.rows] = self._decode(query, layer_cache, md, scale, window, softcap)
        start = 0
        block_size = layer_cache.shape[2]
        for i, (q_len, seq_len) in enumerate(zip(md.query_lens_cpu, md.seq_lens_cpu)):
            end = start + q_len
            if decode is not None and i in decode.seq_ids:
                pass  # decode rows: computed above
            elif q_len == seq_len:
                out[start:end] = reference.causal_attention(query[start:end], key[start:end],
                                                            value[start:end], scale, window, softcap)
            else:
                first = reference.window_start(seq_len - q_len, window) // block_size
                k, v = reference.gather_kv(layer_cache, md.block_tables[i], seq_len, query.dtype, first)
                out[start:end] = reference.causal_attention(query[start:end], k, v, scale, window, softcap)
            start = end
        return out


def _triton() -> AttentionBackend:
    from engine.attention.triton_backend import TritonBackend  # imports triton: only when chosen

    return TritonBackend()


BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "reference": AttentionBackend, "torch": TorchBackend, "triton": _triton}


def get_backend(name: str, device: str) -> AttentionBackend:
    """'auto': the Triton kernels on CUDA, plain torch (and the C decode kernel) on CPU."""
    if name == "auto":
        name = "triton" if device.startswith("cuda") else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(BACKENDS)}")
    if name == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the triton attention backend runs on CPU only under the Triton "
                         "interpreter (TRITON_INTERPRET=1, very slow); use 'torch' on CPU")
    return BACKENDS[name]()
