"""The Triton attention backend: the default on CUDA (engine/kernels/)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import reference
from engine.attention.backend import AttentionBackend, plan_decode_rows
from engine.attention.metadata import AttentionMetadata
from engine.kernels.decode_attention import decode_attention, num_splits_for
from engine.kernels.prefill_attention import default_config as prefill_config
from engine.kernels.prefill_attention import plan_tiles, prefill_attention
from engine.kernels.store_kv import store_kv
from engine.staging import Uploader


@dataclass
class TritonStepState:
    """Everything the kernels need beyond the metadata, built once per step on the host.

    A CUDA graph captures a step with one of these built over static buffers; replays
    then only refill those buffers.
    """

    decode_rows: torch.Tensor | None  # [B] int32 token index of each decode sequence
    decode_tables: torch.Tensor | None  # [B, max_blocks] int32
    decode_seq_lens: torch.Tensor | None  # [B] int32
    tile_seq: torch.Tensor | None  # [tiles] int32, prefill query tiles (plan_tiles)
    tile_start: torch.Tensor | None
    num_splits: int  # decode split-KV factor
    prompt_seqs: tuple[int, ...] = ()  # the sequences that are not decode rows (MLA's torch prompt path)
    max_context: int = 1  # the longest decode row's context (MLA's split-KV factor)


class TritonBackend(AttentionBackend):
    """Decode rows through the paged decode kernel (split-KV), every other sequence
    through the varlen prefill kernel; both read keys through the block table."""

    name = "triton"

    def __init__(self) -> None:
        self._uploader: Uploader | None = None

    def prepare(self, md: AttentionMetadata, block_size: int) -> None:
        if self._uploader is None:
            self._uploader = Uploader(md.slot_mapping.device)
        q_lens = md.query_lens_cpu
        plan = plan_decode_rows(q_lens, md.seq_lens_cpu, md.num_drafts_cpu)  # decode and verify rows
        prefill = [i for i in range(md.num_seqs) if i not in plan.seq_ids]
        tile_seq, tile_start = plan_tiles(q_lens, prefill, prefill_config(md.slot_mapping.device).block_m)
        rows, dec_index, dec_lens, tile_seq_t, tile_start_t = self._uploader.upload(
            np.asarray(plan.token_rows, dtype=np.int32), np.asarray(plan.table_rows, dtype=np.int64),
            np.asarray(plan.context_lens, dtype=np.int32), tile_seq, tile_start)
        decode_rows: torch.Tensor | None = rows
        tables: torch.Tensor | None = None
        lens: torch.Tensor | None = None
        if not plan.seq_ids:
            decode_rows = None
        elif len(plan.token_rows) == md.num_seqs == len(plan.seq_ids):  # pure decode: already in row order
            tables, lens = md.block_tables, md.seq_lens
        else:
            tables, lens = md.block_tables[dec_index], dec_lens
        md.backend_state = TritonStepState(
            decode_rows, tables, lens, tile_seq_t if prefill else None, tile_start_t if prefill else None,
            num_splits_for(max(plan.context_lens, default=1)), tuple(prefill), max(plan.context_lens, default=1))

    def store_kv(self, layer_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 md: AttentionMetadata) -> None:
        store_kv(layer_cache, key, value, md.slot_mapping)

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  layer_cache: torch.Tensor, md: AttentionMetadata, scale: float,
                  window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        state: TritonStepState = md.backend_state
        out = torch.empty_like(query)
        if state.decode_rows is not None:
            assert state.decode_tables is not None and state.decode_seq_lens is not None  # set with decode_rows
            decode_attention(out, query, layer_cache, state.decode_rows, state.decode_tables,
                             state.decode_seq_lens, scale, state.num_splits, window=window,
                             softcap=softcap)
        if state.tile_seq is not None:
            assert state.tile_start is not None  # set with tile_seq
            prefill_attention(out, query, layer_cache, md.block_tables, md.seq_lens,
                              md.query_start_loc, state.tile_seq, state.tile_start, scale, window=window,
                              softcap=softcap)
        return out

    def latent_attention(self, query: torch.Tensor, latent: torch.Tensor, layer_cache: torch.Tensor,
                         md: AttentionMetadata, scale: float, kv_lora_rank: int) -> torch.Tensor:
        """MLA: the latent (kv_lora_rank + rope, 576 for DeepSeek) is not the power-of-two
        width the K/V kernels take. Stored by indexing and prompt chunks attended in torch
        (both synchronise with the host: no CUDA graphs with MLA, engine/builder.py);
        decode and verify rows through the MLA decode kernel, which reads each latent
        tile once for all the heads."""
        from engine.kernels.mla_decode import mla_decode_attention
        from engine.kernels.mla_decode import num_splits_for as mla_splits

        reference.store_kv(layer_cache, latent, latent, md.slot_mapping)
        state: TritonStepState = md.backend_state
        out = query.new_empty(query.shape[0], query.shape[1], kv_lora_rank)
        if state.decode_rows is not None:
            assert state.decode_tables is not None and state.decode_seq_lens is not None  # set with decode_rows
            rows = state.decode_rows.long()
            decoded = query.new_empty(rows.shape[0], query.shape[1], kv_lora_rank)
            mla_decode_attention(decoded, query[rows].contiguous(), layer_cache, state.decode_tables,
                                 state.decode_seq_lens, scale, kv_lora_rank, num_splits=mla_splits(state.max_context))
            out[rows] = decoded
        starts = np.cumsum([0, *md.query_lens_cpu])
        for i in state.prompt_seqs:
            k, v = reference.gather_kv(layer_cache, md.block_tables[i], md.seq_lens_cpu[i], query.dtype)
            q = query[starts[i]:starts[i + 1]]
            out[starts[i]:starts[i + 1]] = reference.causal_attention(q, k, v, scale)[..., :kv_lora_rank]
        return out
