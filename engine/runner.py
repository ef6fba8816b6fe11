"""Model runner: owns the model and the KV cache tensor; turns a schedule into tokens."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np
import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata, attention_context
from engine.errors import EngineStateError, RankFailure
from engine.kv_cache.layout import cache_shape
from engine.lora.layers import LoRAStep, lora_step
from engine.model.config import ModelConfig
from engine.model.llama import LlamaForCausalLM
from engine.prompt_logprobs import PendingPromptLogprobs, PromptRows
from engine.sampling import PendingSample, Sampler, SamplerOutput, SamplingRow
from engine.sampling.pending import small_tensor
from engine.scheduler_output import ScheduledRequest
from engine.staging import Uploader

if TYPE_CHECKING:
    from engine.cuda_graphs import CudaGraphRunner  # which imports this module

KVAllocator = Callable[[tuple[int, ...], torch.dtype, str], torch.Tensor]


class TPSteps(Protocol):
    """What the runner needs of a tensor-parallel driver (engine/distributed/driver.py)."""

    def broadcast_step(self, inputs: StepInputs) -> None: ...

    def out_of_step(self, reason: str) -> RankFailure: ...


def kv_cache_shape(cfg: ModelConfig, num_blocks: int, block_size: int,
                   num_kv_heads: int | None = None) -> tuple[int, ...]:
    """The cache's shape (allocate_kv_cache) for a rank holding num_kv_heads heads (None: all)."""
    heads = cfg.num_kv_heads if num_kv_heads is None else num_kv_heads
    if heads < 1:
        raise ValueError(f"num_kv_heads must be >= 1, got {heads}")
    return cache_shape(num_blocks, heads, cfg.num_layers, block_size, cfg.head_dim, cfg.kv_planes)


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: str, allocator: KVAllocator | None = None,
                      num_kv_heads: int | None = None) -> torch.Tensor:
    """[num_blocks, num_kv_heads, num_layers, planes, block_size, head_dim] (kv_cache/layout.py).

    Block-major, so a run of consecutive blocks moves between workers as one descriptor;
    heads outside layers, so a slice of one block's heads (what a tensor-parallel rank
    of another size holds) is one contiguous region too. `num_kv_heads`: the heads this
    worker holds (a tensor-parallel rank's share); None = all of the model's.
    `allocator` (shape, dtype, device) places it where a KV transport can reach it
    (e.g. shared memory).
    """
    shape = kv_cache_shape(cfg, num_blocks, block_size, num_kv_heads)
    if allocator is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    return allocator(shape, dtype, device)


@dataclass
class StepInputs:
    """One step's flattened batch on the host, before upload."""

    input_ids: np.ndarray  # [T] int64; 0 at placeholders
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64, cache slot of each token's K/V
    query_start_loc: np.ndarray  # [S + 1] int32
    seq_lens: np.ndarray  # [S] int32, context after this step
    block_tables: np.ndarray  # [S, max_blocks] int32
    logits_indices: np.ndarray  # [R] int64, tokens whose logits are sampled
    query_lens: list[int]
    # Tokens sampled by the step in flight, whose ids are not on the host yet (async
    # scheduling): their index in input_ids, and the request each belongs to.
    placeholder_index: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    placeholder_requests: list[str] = field(default_factory=list)
    # [C, 2] int64 (source, destination) KV blocks every rank copies before the forward.
    block_copies: np.ndarray = field(default_factory=lambda: np.empty((0, 2), dtype=np.int64))
    # [S] int32: the drafts among each sequence's new tokens (speculative decoding);
    # empty when the step has none.
    num_drafts: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int32))
    # [S] int64: each sequence's LoRA slot (-1: the base model); empty when none has one.
    lora_slots: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))

    @property
    def is_pure_decode(self) -> bool:
        return len(self.input_ids) == len(self.query_lens)


class DeviceInputs(NamedTuple):
    """StepInputs' arrays on the device, after the step's one upload."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    logits_indices: torch.Tensor


def build_step_inputs(scheduled: Sequence[ScheduledRequest], block_tables: np.ndarray,
                      block_size: int) -> StepInputs:
    """Flatten a step. block_tables: [S, max_blocks] int32, row i = scheduled[i]'s blocks.

    One Python pass reads each request's counters and new token ids; the per-token
    arrays are then numpy over the whole batch. Per-request numpy calls would cost more
    than everything else here together at decode batch sizes.
    """
    num_seqs = len(scheduled)
    starts, query_lens, samples, token_ids = [], [], [], []
    placeholder_index, placeholder_requests = [], []
    num_drafts = []  # speculative decoding: per sequence
    lora_slots = []  # per sequence, its LoRA slot (-1: none)
    for s in scheduled:
        lora = s.request.lora
        lora_slots.append(-1 if lora is None else lora.slot)
        start, n = s.start, s.num_new_tokens
        starts.append(start)
        query_lens.append(n)
        samples.append(s.samples)
        drafts = s.draft_token_ids
        known = s.request.all_token_ids[start:start + n - len(drafts)]
        token_ids += known
        if len(known) < n - len(drafts):  # the last token was sampled by the step in flight: one at most
            placeholder_index.append(len(token_ids))
            placeholder_requests.append(s.request.request_id)
            token_ids.append(0)
        token_ids += drafts
        num_drafts.append(len(drafts))
    start_arr = np.array(starts, dtype=np.int64)
    len_arr = np.array(query_lens, dtype=np.int64)
    ends = np.cumsum(len_arr)  # exclusive end of each sequence's tokens in the batch
    if (len_arr == 1).all():  # pure decode
        seq_of_token, positions = np.arange(num_seqs), start_arr
    else:
        seq_of_token = np.repeat(np.arange(num_seqs), len_arr)
        # position = token index in the batch - its sequence's first index + its start
        positions = np.arange(len(token_ids)) + np.repeat(start_arr - (ends - len_arr), len_arr)
    blocks = block_tables[seq_of_token, positions // block_size].astype(np.int64)
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)
    query_start_loc[1:] = ends
    sampled = np.array(samples, dtype=bool)
    logits_indices = (ends - 1)[sampled]
    drafted = any(num_drafts)
    if drafted:  # a row for each draft and one after them, in order
        rows = np.array(num_drafts, dtype=np.int64)[sampled] + 1
        first = np.repeat(logits_indices - rows + 1, rows)
        logits_indices = first + np.arange(len(first)) - np.repeat(np.cumsum(rows) - rows, rows)
    return StepInputs(
        input_ids=np.array(token_ids, dtype=np.int64), positions=positions,
        slot_mapping=blocks * block_size + positions % block_size,
        query_start_loc=query_start_loc, seq_lens=(start_arr + len_arr).astype(np.int32),
        block_tables=block_tables, logits_indices=logits_indices,
        query_lens=query_lens, placeholder_index=np.array(placeholder_index, dtype=np.int64),
        placeholder_requests=placeholder_requests,
        num_drafts=np.array(num_drafts, dtype=np.int32) if drafted else np.empty(0, dtype=np.int32),
        lora_slots=np.array(lora_slots, dtype=np.int64) if max(lora_slots, default=-1) >= 0
        else np.empty(0, dtype=np.int64))


def _fill_placeholders(inputs: StepInputs, in_flight: LaunchedStep | None) -> StepInputs:
    """The step with the ids of the tokens the step in flight sampled in place of its
    placeholders, waiting for them (tensor parallel: followers embed the ids too)."""
    if not inputs.placeholder_requests:
        return inputs
    if in_flight is None or in_flight.sample is None:
        raise EngineStateError("placeholder tokens without a step in flight to fill them")
    rows = [in_flight.sample_row[r] for r in inputs.placeholder_requests]
    input_ids = inputs.input_ids.copy()
    input_ids[inputs.placeholder_index] = in_flight.sample.token_ids[rows].cpu().numpy()
    return dataclasses.replace(inputs, input_ids=input_ids, placeholder_index=np.empty(0, dtype=np.int64),
                               placeholder_requests=[])


def sampling_rows(scheduled: Sequence[ScheduledRequest]) -> tuple[list[SamplingRow], list[int] | None]:
    """A step's sampled rows in order, and (speculative decoding) the draft each
    verifies, -1 for none; None when the step has no drafts. A request with d drafts
    has d + 1 rows: row j verifies draft j as it stands after drafts [0, j)."""
    if not any(s.draft_token_ids for s in scheduled):
        return [s.request.sampling_row for s in scheduled if s.samples], None
    rows, drafts = [], []
    for s in scheduled:
        if not s.samples:
            continue
        row, ids = s.request.sampling_row, list(s.draft_token_ids)
        rows += [row] + [row.after(ids[:j]) for j in range(1, len(ids) + 1)]
        drafts += ids + [-1]
    return rows, drafts


class LaunchedStep:
    """A step queued on the device: its sampled tokens (if any) on their way back, and
    an event after its last kernel (a step that samples nothing, such as a prompt chunk
    on a prefill worker, still has KV to finish writing)."""

    def __init__(self, scheduled: Sequence[ScheduledRequest], sample: PendingSample | None,
                 device: torch.device, prompt_logprobs: PendingPromptLogprobs | None = None) -> None:
        self.sample = sample
        self.prompt_logprobs = prompt_logprobs  # landed by the engine core with the tokens
        self._scheduled = scheduled
        self._done = None
        if device.type == "cuda":
            self._done = torch.cuda.Event()
            self._done.record(torch.cuda.current_stream(device))

    @cached_property
    def sample_row(self) -> dict[str, int]:
        """Row of each sampling request's token in `sample` (read when the next step's
        placeholders are filled in; most steps have none)."""
        sampling = [s.request.request_id for s in self._scheduled if s.samples]
        return {request_id: i for i, request_id in enumerate(sampling)}

    def result(self) -> SamplerOutput:
        """Wait for this step (not for any step queued after it) and return its tokens."""
        if self._done is not None:
            self._done.synchronize()
        return self.sample.result() if self.sample is not None else SamplerOutput([], [])


class ModelRunner:
    """Called by the engine core once per step with the scheduler's output.

    On CUDA, pure-decode steps replay captured CUDA graphs when `graphs` is set
    (engine/cuda_graphs.py); every other step runs eagerly.
    """

    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int,
                 sampler: Sampler | None, attention_backend: AttentionBackend, device: str,
                 tp: TPSteps | None = None) -> None:
        """sampler None: a tensor-parallel follower, which only runs forwards.
        tp: the tensor-parallel driver, given each step's inputs before its forward (the
        other ranks run the same forward on them)."""
        self.model = model
        self.tp = tp
        self.attention_backend = attention_backend
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.sampler = sampler
        self.device = torch.device(device)
        self.uploader = Uploader(self.device)
        self.graphs: CudaGraphRunner | None = None  # set by the engine core after capture
        model.bind_kv_cache(kv_cache)

    def upload(self, inputs: StepInputs, in_flight: LaunchedStep | None = None) -> DeviceInputs:
        """The step's arrays on the device in one copy; placeholder input ids are then
        filled from the tokens `in_flight` sampled, on the device."""
        src = np.empty(0, dtype=np.int64)
        sampled = None  # [rows] the tokens in_flight sampled, when this step has placeholders
        if inputs.placeholder_requests:
            if in_flight is None or in_flight.sample is None:  # their input ids would be garbage
                raise EngineStateError("placeholder tokens without a step in flight to fill them")
            sampled = in_flight.sample.token_ids
            src = np.array([in_flight.sample_row[r] for r in inputs.placeholder_requests], dtype=np.int64)
        *arrays, dst_t, src_t = self.uploader.upload(
            inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.query_start_loc,
            inputs.seq_lens, inputs.block_tables, inputs.logits_indices, inputs.placeholder_index, src)
        dev = DeviceInputs(*arrays)
        if sampled is not None:
            dev.input_ids.index_copy_(0, dst_t, sampled.index_select(0, src_t))
        return dev

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, dev: DeviceInputs | None = None) -> torch.Tensor:
        """Logits [R, vocab] float32 for inputs.logits_indices, eagerly (uploading the
        inputs unless `dev` has them)."""
        dev = self.upload(inputs) if dev is None else dev
        self.copy_blocks(inputs)
        md = AttentionMetadata(slot_mapping=dev.slot_mapping, query_start_loc=dev.query_start_loc,
                               seq_lens=dev.seq_lens, block_tables=dev.block_tables,
                               query_lens_cpu=inputs.query_lens, seq_lens_cpu=inputs.seq_lens.tolist(),
                               num_drafts_cpu=inputs.num_drafts.tolist() if len(inputs.num_drafts) else None)
        self.attention_backend.prepare(md, self.block_size)
        lora = None if not len(inputs.lora_slots) else LoRAStep.of(
            np.repeat(inputs.lora_slots, inputs.query_lens), self.device)
        with attention_context(md), lora_step(lora):
            return self.model(dev.input_ids, dev.positions, dev.logits_indices)

    @torch.inference_mode()
    def launch(self, scheduled: Sequence[ScheduledRequest], block_tables: np.ndarray,
               in_flight: LaunchedStep | None = None, block_copies: Sequence[tuple[int, int]] = (),
               prompt_rows: PromptRows | None = None) -> LaunchedStep:
        """Queue one forward over all scheduled tokens and the sampling of one token for
        each request whose step reaches its last token (in `scheduled` order); nothing
        waits for the device. block_tables: [S, max_blocks] int32
        (KVCacheManager.block_tables). `in_flight`: the step still running, whose
        sampled tokens are this step's placeholder input ids. `block_copies`: KV
        blocks (source, destination) to copy first (SchedulerOutput.block_copies).
        `prompt_rows`: prompt positions whose logits are projected too, after the
        sampled rows, for their prompt logprobs (engine/prompt_logprobs.py)."""
        inputs = build_step_inputs(scheduled, block_tables, self.block_size)
        if block_copies:
            inputs.block_copies = np.array(block_copies, dtype=np.int64).reshape(-1, 2)
        num_sampled = len(inputs.logits_indices)
        if prompt_rows is not None:
            inputs.logits_indices = np.concatenate((inputs.logits_indices, prompt_rows.token_index))
        if self.tp is None:
            logits = self._forward(inputs, in_flight, prompt_rows is None)
        else:
            inputs = _fill_placeholders(inputs, in_flight)  # the other ranks need the token ids
            self.tp.broadcast_step(inputs)
            try:
                logits = self._forward(inputs, None, prompt_rows is None)
            except RankFailure:
                raise
            except Exception as exc:
                raise self.tp.out_of_step(f"{type(exc).__name__}: {exc}") from exc
        rows, drafts = sampling_rows(scheduled)
        if prompt_rows is None:
            return LaunchedStep(scheduled, self._sample(logits, rows, drafts), self.device)
        sample = self._sample(logits[:num_sampled], rows, drafts)
        return LaunchedStep(scheduled, sample, self.device, PendingPromptLogprobs(logits[num_sampled:], prompt_rows))

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], drafts: list[int] | None) -> PendingSample | None:
        if not rows:
            return None
        assert self.sampler is not None  # only the driver's runner samples (followers' and drafts' run forwards)
        return self.sampler.sample(logits, rows, drafts)

    def _forward(self, inputs: StepInputs, in_flight: LaunchedStep | None, graphs: bool = True) -> torch.Tensor:
        """graphs False: a step with prompt-logprob rows (a graph projects one row per sequence)."""
        dev = self.upload(inputs, in_flight)
        if graphs and self.graphs is not None and self.graphs.can_run(inputs):
            self.copy_blocks(inputs)
            return self.graphs.run(inputs, dev)
        return self.forward(inputs, dev)

    def copy_blocks(self, inputs: StepInputs) -> None:
        """Make the step's KV block copies (a forked sequence's shared last block)
        before its forward writes into them; queued on the device like the forward."""
        if len(inputs.block_copies):
            # Staged like the sampler's small tensors: a plain upload would wait for the
            # step in flight (async scheduling).
            src = small_tensor(self.device, inputs.block_copies[:, 0].tolist())
            dst = small_tensor(self.device, inputs.block_copies[:, 1].tolist())
            # Moved as raw bytes: index_copy_ has no float8 kernel on CPU, and a
            # block copy never needs the values.
            cache = self.kv_cache.view(torch.uint8) if self.kv_cache.element_size() == 1 else self.kv_cache
            cache.index_copy_(0, dst, cache.index_select(0, src))

    def wait_idle(self) -> None:
        """Wait until the device has run (or failed) everything queued so far."""
        if self.device.type == "cuda":
            try:
                torch.cuda.synchronize(self.device)
            except RuntimeError:
                pass  # the device failed; the caller is already handling an error

    def execute(self, scheduled: Sequence[ScheduledRequest], block_tables: np.ndarray) -> SamplerOutput:
        """launch() and wait for its tokens."""
        return self.launch(scheduled, block_tables).result()
