"""Draft-model proposals (speculative decoding): a smaller model with the target's
vocabulary proposes each request's next tokens, its greedy argmax.

The draft has its own paged KV cache with the target's block count and block size,
indexed by the target request's block table: block b of a request holds its target KV
in the target's cache and its draft KV in this one. So the draft needs no allocator,
and its blocks are freed, shared (prefix hits, forks) and preempted with the target's.
The invariant: a request's first `num_draft_computed` tokens have their draft KV in
its blocks. The scheduler sets it on admission (prefix hits are trusted; a prompt whose
KV a prefill worker pushed has none past the local hits); fill() checks a newly
admitted request's hit blocks against what the draft computed in them (DraftBlocks),
catches up from there to the request's last token, and sets it to the request's
length. The draft KV written at draft positions is never trusted: the next catch-up
recomputes it from the tokens the target accepted.

Disaggregated serving: the prefill worker pushes only the target's KV, and the decode
worker's first fill() of a request computes the prompt's draft KV itself (a catch-up
over the whole prompt, in forwards of at most max_num_batched_tokens tokens). Pushing
the draft's KV too would need the draft loaded on every prefill worker and a second
cache registered with every transport, to save a draft prefill that costs a fraction
of the target's.

Tensor parallelism: the draft runs unsharded on rank 0 (the driver) only; its
forwards are not broadcast.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.backend import AttentionBackend
from engine.attention.kv_quant import cache_dtype
from engine.config import EngineConfig
from engine.distributed.rank_model import build_rank_model
from engine.kv_cache.block_hash import hash_full_blocks
from engine.kv_cache.manager import KVCacheManager
from engine.model.config import ModelConfig
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import TORCH_DTYPES
from engine.request import Request
from engine.runner import ModelRunner, StepInputs, allocate_kv_cache, build_step_inputs
from engine.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.speculative.draft_check import check_draft, draft_model_dir, load_failure


@dataclass
class LoadedDraft:
    """A draft model's weights, loaded before the KV pool is sized (on CUDA the
    profiling step counts them, engine/gpu_memory.py)."""

    model: LlamaForCausalLM
    config: ModelConfig
    backend: AttentionBackend  # its own: a backend keeps per-step state (prepare)


def load_draft(config: EngineConfig, target: ModelConfig, model_len: int) -> LoadedDraft:
    """Check config.speculative_config.model against the target model (check_draft)
    and load it: unsharded, with the target's dtype, device and load format. Raises
    ValueError naming speculative_config.model and the reason."""
    draft_dir = draft_model_dir(config)
    draft = check_draft(config, target, model_len)
    draft_config = dataclasses.replace(config, model=draft_dir, tensor_parallel_size=1, max_model_len=model_len,
                                       speculative_config=None)
    try:
        model, _, backend, _ = build_rank_model(draft_config)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"speculative_config.model {draft_dir!r} does not load as a draft model: "
                         f"{load_failure(exc)}") from exc
    return LoadedDraft(model, draft, backend)


class DraftModelProposer:
    """Called by the Speculator (EngineCore.step) once per step that has draft
    placeholders, after schedule() allocated their slots and before the target's
    forward: fill() writes each request's drafts in place of its placeholders."""

    def __init__(self, draft: LoadedDraft, config: EngineConfig, num_blocks: int, kv: KVCacheManager) -> None:
        self.kv = kv
        self.block_size = config.block_size
        self.max_tokens = config.max_num_batched_tokens  # per draft forward, as per target step
        # Not a transport's memory: the draft's KV never leaves this worker.
        cache = allocate_kv_cache(draft.config, num_blocks, config.block_size,
                                  cache_dtype(config.kv_cache_dtype, TORCH_DTYPES[config.dtype]), config.device)
        self.runner = ModelRunner(draft.model, cache, config.block_size, None, draft.backend, config.device)
        # Without prefix caching no request starts on blocks another one computed.
        self.blocks = DraftBlocks(num_blocks, config.block_size) if kv.enable_prefix_caching else None

    @property
    def kv_cache(self) -> torch.Tensor:
        """[num_blocks, num_kv_heads, num_layers, 2, block_size, head_dim]: the draft's KV."""
        return self.runner.kv_cache

    @torch.inference_mode()
    def fill(self, out: SchedulerOutput) -> None:
        """Replace each scheduled request's placeholder drafts (d of them) with the
        draft model's greedy tokens: a catch-up over its tokens [num_draft_computed, L)
        whose last logits give draft 1, then d - 1 one-token forwards, batched across
        requests. Greedy for sampled requests too: verification treats each draft as
        a deterministic proposal, which keeps rejection sampling exact."""
        work = [s for s in out.scheduled if s.draft_token_ids]
        if not work:
            return
        tables = self.kv.block_tables([s.request.request_id for s in work])
        ends = [s.request.num_tokens for s in work]  # L: the last token, L - 1, is known
        counts = [len(s.draft_token_ids) for s in work]
        # The last token always runs, for its logits: num_draft_computed is L after a
        # step that was discarded (it failed) and left the request as it was.
        starts = [min(s.request.speculation.num_draft_computed, end - 1) for s, end in zip(work, ends)]
        if self.blocks is not None:
            starts = [self.blocks.trusted(s.request, start, row) for s, start, row in zip(work, starts, tables)]
        # Blocks released out of a sliding window have no place to hold draft KV (their
        # table entries are 0, another request's block): a catch-up starts after them.
        # The draft's KV just past them then attends over what block 0 holds: its
        # drafts there are worse, never wrong (the target verifies them).
        starts = [max(start, self.kv.num_released(s.request.request_id) * self.block_size)
                  for s, start in zip(work, starts)]
        if self.blocks is not None:
            for start, end, n, row in zip(starts, ends, counts, tables):
                self.blocks.forget(row, start, end + n - 1)  # what this fill overwrites
        drafts = torch.empty((len(work), max(counts)), dtype=torch.int64, device=self.runner.device)
        self._catch_up(work, starts, ends, tables, drafts)
        for i in range(1, max(counts)):
            rows = [j for j, n in enumerate(counts) if n > i]
            # Draft i - 1 at position L + i - 1; build_step_inputs reads a token past the
            # request's known ones as a placeholder, whose id is on the device.
            scheduled = [ScheduledRequest(work[j].request, ends[j] + i - 1, 1, True) for j in rows]
            inputs = _without_placeholders(build_step_inputs(scheduled, tables[rows], self.block_size))
            dev = self.runner.upload(inputs)._replace(input_ids=drafts[rows, i - 1])
            drafts[rows, i] = self.runner.forward(inputs, dev).argmax(-1)
        for s, tokens, n, start, row in zip(work, drafts.tolist(), counts, starts, tables):  # the one wait
            s.draft_token_ids = tokens[:n]
            s.request.speculation.num_draft_computed = s.request.num_tokens
            if self.blocks is not None:
                self.blocks.computed(s.request, start, row)

    def _catch_up(self, work: Sequence[ScheduledRequest], starts: Sequence[int], ends: Sequence[int],
                  tables: np.ndarray, drafts: torch.Tensor) -> None:
        """Compute each request's draft KV over its tokens [start, L) and write the
        argmax after its last token into drafts[:, 0]; in forwards of at most
        max_num_batched_tokens tokens, a long catch-up (a pushed prompt) split over
        several."""
        batch: list[ScheduledRequest] = []
        rows: list[int] = []  # each batch entry's row in `work`
        room = self.max_tokens
        for j, (s, start) in enumerate(zip(work, starts)):
            while start < ends[j]:
                n = min(ends[j] - start, room)
                batch.append(ScheduledRequest(s.request, start, n, start + n == ends[j]))
                rows.append(j)
                start, room = start + n, room - n
                if room == 0:
                    self._forward_chunk(batch, rows, tables, drafts)
                    batch, rows, room = [], [], self.max_tokens
        if batch:
            self._forward_chunk(batch, rows, tables, drafts)

    def _forward_chunk(self, batch: list[ScheduledRequest], rows: list[int], tables: np.ndarray,
                       drafts: torch.Tensor) -> None:
        logits = self.runner.forward(build_step_inputs(batch, tables[rows], self.block_size))
        ending = [j for s, j in zip(batch, rows) if s.samples]
        if ending:
            drafts[ending, 0] = logits.argmax(-1)


class DraftBlocks:
    """Which full blocks hold draft KV, and for which tokens: per block id, the chained
    hash (kv_cache/block_hash.py, which names a block's whole prefix) of the tokens
    the draft last computed it for; 0 for none.

    The scheduler has a request trust its prefix hits' draft KV (num_draft_computed),
    but the request that cached a block may never have run the draft over it: it
    sampled a single token, or stopped speculating, or its prompt was a prefill-only
    request. trusted() checks each hit against this record, once per admission."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.hashes = np.zeros(num_blocks, dtype=np.uint64)
        # The num_draft_computed each request was left with by the last fill, and its
        # preemptions then: a different pair means the scheduler admitted it since.
        self._filled: weakref.WeakKeyDictionary[Request, tuple[int, int]] = weakref.WeakKeyDictionary()

    def trusted(self, request: Request, start: int, row: np.ndarray) -> int:
        """Where the request's catch-up starts: `start`, or earlier at the first of its
        (newly admitted) hit blocks whose draft KV is not of its tokens."""
        if self._filled.get(request) == (request.speculation.num_draft_computed, request.num_preemptions):
            return start  # its own fills computed everything before
        hashes = request.block_hashes  # of its hits at least: the lookup hashed them
        for i in range(start // self.block_size):
            if i >= len(hashes) or self.hashes[row[i]] != np.uint64(hashes[i]):
                return i * self.block_size
        return start // self.block_size * self.block_size

    def forget(self, row: np.ndarray, start: int, end: int) -> None:
        """Tokens [start, end) of the request with block table `row` are about to be
        written: the blocks holding them are no longer what the record says."""
        self.hashes[row[start // self.block_size:-(-end // self.block_size)]] = 0

    def computed(self, request: Request, start: int, row: np.ndarray) -> None:
        """The request's draft KV is now computed for all its tokens, [start, L) by this fill."""
        num_full = request.num_tokens // self.block_size
        first = start // self.block_size
        if num_full > first:
            hashes = hash_full_blocks(request.all_token_ids, self.block_size, request.block_hashes[:num_full])
            self.hashes[row[first:num_full]] = np.array(hashes[first:num_full], dtype=np.uint64)
        self._filled[request] = (request.speculation.num_draft_computed, request.num_preemptions)


def _without_placeholders(inputs: StepInputs) -> StepInputs:
    return dataclasses.replace(inputs, placeholder_index=np.empty(0, dtype=np.int64), placeholder_requests=[])
