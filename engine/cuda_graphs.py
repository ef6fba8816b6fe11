"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed.

A decode step of a small model is dominated by kernel launch overhead: hundreds of
launches of microsecond kernels. Capturing the whole forward once per bucket and
replaying it turns that into one launch. A speculative verify step (each sequence's
last token and its drafts, every one sampled) replays the same graphs with a decode
row per token, each over the context up to that token. Each graph reads static buffers; a step
copies its inputs into them, pads the batch up to the bucket (padding rows write to
slot -1 and attend over one token of block 0, and their logits are dropped), replays
and slices the logits. Prefill and mixed steps, batches above the largest bucket and
contexts past MAX_CONTEXT run eagerly. Outputs are identical either way: the same
kernels on the same data, with the same split-KV boundaries (decode_attention.py).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata, attention_context
from engine.attention.triton_backend import TritonBackend, TritonStepState
from engine.kernels.decode_attention import num_splits_for
from engine.model.llama import LlamaForCausalLM
from engine.runner import DeviceInputs, StepInputs
from engine.sampling.pending import small_tensor

logger = logging.getLogger(__name__)

# Longest context a graph serves. Graphs launch enough decode splits for it, and each
# unused split is a program that exits at once: cheap for 8k, not for 128k.
MAX_CONTEXT = 8192


def batch_buckets(max_num_seqs: int, max_rows: int | None = None) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (and max_num_seqs
    itself); up to max_rows (speculative verify steps: a row per token) every multiple
    of 64 beyond, and max_rows itself."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    top = max(max_num_seqs, max_rows or 0)
    sizes += list(range(-(-max_num_seqs // 64) * 64, top + 1, 64))
    return sorted(set(sizes) | {max_num_seqs, top})


class CudaGraphRunner:
    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend, max_num_seqs: int,
                 max_model_len: int, block_size: int, device: torch.device, max_rows: int | None = None) -> None:
        """max_rows: the most tokens a verify step has (speculative decoding), when
        more than max_num_seqs."""
        if not isinstance(backend, TritonBackend):
            raise ValueError(f"CUDA graphs need the triton attention backend, got {backend.name!r}")
        self.model = model
        self.backend = backend
        self.buckets = batch_buckets(max_num_seqs, max_rows)
        self.max_context = min(max_model_len, MAX_CONTEXT)
        self.device = device
        n, max_blocks = self.buckets[-1], -(-self.max_context // block_size)
        i64: dict[str, Any] = dict(dtype=torch.int64, device=device)  # factory keywords
        i32: dict[str, Any] = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.full((n,), -1, **i64)
        self.seq_lens = torch.ones(n, **i32)
        self.block_tables = torch.zeros((n, max_blocks), **i32)
        self.query_start_loc = torch.arange(n + 1, **i32)
        self.rows = torch.arange(n, **i32)
        self.logits_indices = torch.arange(n, **i64)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Every graph writes its logits here: a graph's own output would stay alive
        # and hold its [size, vocab] in the pool, for every bucket.
        self.logits: torch.Tensor | None = None
        self.pool: Any = None  # the graphs' shared memory pool (torch's private handle type), once one is captured

    def _metadata(self, size: int) -> AttentionMetadata:
        """Metadata over the first `size` rows of the static buffers."""
        md = AttentionMetadata(self.slot_mapping[:size], self.query_start_loc[:size + 1],
                               self.seq_lens[:size], self.block_tables[:size], [1] * size,
                               [self.max_context] * size)
        # Splits for the longest context a graph serves: a shorter one leaves trailing
        # splits empty (an early exit each) and gets the same result as eager mode.
        md.backend_state = TritonStepState(self.rows[:size], self.block_tables[:size],
                                           self.seq_lens[:size], None, None,
                                           num_splits_for(self.max_context))
        return md

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so smaller graphs reuse its memory pool."""
        for size in reversed(self.buckets):
            md = self._metadata(size)
            args = (self.input_ids[:size], self.positions[:size], self.logits_indices[:size])
            with attention_context(md):
                warm = self.model(*args)  # warm-up: Triton compiles outside the capture
                logits = self.logits
                if logits is None:  # the largest bucket comes first
                    logits = self.logits = torch.empty_like(warm)
                del warm
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    logits[:size].copy_(self.model(*args))
            self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured %d CUDA graphs for decode batches up to %d", len(self.graphs), self.buckets[-1])

    def can_run(self, inputs: StepInputs) -> bool:
        """Pure-decode steps, and speculative verify steps: each sequence computes its
        last token and its drafts (at most MAX_ROWS_PER_SEQUENCE tokens over a cached
        context) and every token is sampled, so each token is a decode row."""
        tokens = len(inputs.input_ids)
        if tokens > self.buckets[-1] or int(inputs.seq_lens.max()) > self.max_context:
            return False
        if inputs.is_pure_decode:
            return True
        query_lens = np.asarray(inputs.query_lens)
        return (len(inputs.logits_indices) == tokens and len(inputs.num_drafts) > 0
                and bool((inputs.num_drafts == query_lens - 1).all()))

    @torch.inference_mode()
    def run(self, inputs: StepInputs, dev: DeviceInputs) -> torch.Tensor:
        """Logits [R, vocab] for the rows inputs.logits_indices of a step can_run()
        accepts, of B <= the largest bucket tokens, whose inputs the runner has
        uploaded (`dev`)."""
        b = len(inputs.input_ids)
        size = next(s for s in self.buckets if s >= b)
        # A request may hold blocks past its context (rejected drafts' slots); the
        # columns a step reads fit, as its contexts do (can_run).
        width = min(inputs.block_tables.shape[1], self.block_tables.shape[1])
        self.input_ids[:b].copy_(dev.input_ids)
        self.positions[:b].copy_(dev.positions)
        self.slot_mapping[:b].copy_(dev.slot_mapping)
        if inputs.is_pure_decode:
            self.seq_lens[:b].copy_(dev.seq_lens)
            self.block_tables[:b, :width].copy_(dev.block_tables[:, :width])
        else:  # a verify step: a decode row per token, over the context up to that token
            self.seq_lens[:b].copy_(dev.positions + 1)
            seq_of_token = np.repeat(np.arange(len(inputs.query_lens)), inputs.query_lens)
            index = small_tensor(self.device, seq_of_token.tolist())
            self.block_tables[:b, :width].copy_(dev.block_tables[:, :width].index_select(0, index))
        if size > b:  # padding rows: nothing stored, one token of block 0 read
            self.slot_mapping[b:size].fill_(-1)
            self.seq_lens[b:size].fill_(1)
            self.block_tables[b:size, 0].fill_(0)
        self.graphs[size].replay()
        assert self.logits is not None  # made by capture(), before any graph exists
        if len(inputs.logits_indices) != b:  # rows that sample nothing (a prompt's last chunk token on a prefill worker)
            return self.logits[:b].index_select(0, dev.logits_indices)
        return self.logits[:b]
