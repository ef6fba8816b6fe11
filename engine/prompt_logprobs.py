"""Prompt logprobs (SamplingParams.prompt_logprobs): the extra logits rows a step
computes for them, and their log-softmax on its way to the host.

Entry j of Request.prompt_logprobs.entries scores prompt token j + 1 with the logits at prompt
position j (the first prompt token has none). A step computes a row for each prompt
position it runs that has no entry yet, in any chunk of a chunked prefill. Entries
land in position order: a position computed again (a preempted request recomputes its
prompt, maybe while a step with its earlier rows is still in flight) is dropped when
it lands rather than appended twice.

Invariant: a step's rows are its sampled rows first, then these (ModelRunner.launch),
so the sampler sees exactly the rows it always did.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.errors import EngineStateError
from engine.request import Request
from engine.sampling import TokenLogprobs
from engine.sampling.pending import small_tensor
from engine.scheduler_output import ScheduledRequest

# Rows whose log-softmax is taken at once: bounds the float32 scratch beyond the
# logits themselves, whatever the chunk size.
_ROWS_PER_PIECE = 1024


@dataclass
class PromptRows:
    """A step's prompt-logprob rows, in row order."""

    token_index: np.ndarray  # [P] int64: each row's token in the step's flattened batch
    target_ids: np.ndarray  # [P] int64: the prompt token each row scores (the next one)
    spans: list[tuple[Request, int, int]]  # (request, first prompt position, rows)
    k: int  # the most top alternatives any of them asks for


def plan_rows(scheduled: Sequence[ScheduledRequest], wanted: Iterable[Request]) -> PromptRows | None:
    """The rows for the `wanted` requests (those with prompt logprobs still to compute)
    among `scheduled`; None if none has a prompt position without an entry this step."""
    wanted = set(wanted)
    index: list[np.ndarray] = []
    targets: list[list[int]] = []
    spans: list[tuple[Request, int, int]] = []
    offset = 0
    for s in scheduled:
        request = s.request
        if request in wanted:
            assert request.prompt_logprobs is not None  # wanted: it needs prompt logprobs, so has a record
            first = max(s.start, len(request.prompt_logprobs.entries))
            end = min(s.start + s.num_new_tokens, request.num_prompt_tokens - 1)
            if first < end:
                index.append(np.arange(offset + first - s.start, offset + end - s.start, dtype=np.int64))
                targets.append(request.prompt_token_ids[first + 1:end + 1])
                spans.append((request, first, end - first))
        offset += s.num_new_tokens
    if not spans:
        return None
    return PromptRows(np.concatenate(index), np.array([t for ts in targets for t in ts], dtype=np.int64),
                      spans, max(r.sampling_params.prompt_logprobs or 0 for r, _, _ in spans))  # all set: wanted


class PendingPromptLogprobs:
    """One step's prompt logprobs, computed on the logits' device in float32 from the
    raw distribution and copied to the host without waiting (as PendingSample)."""

    def __init__(self, logits: torch.Tensor, rows: PromptRows) -> None:
        """logits: [P, vocab] for rows.token_index, in order."""
        self.spans, self.k = rows.spans, rows.k
        device = logits.device
        targets = small_tensor(device, rows.target_ids.tolist())
        chosen, ranks, top_v, top_i = [], [], [], []
        for at in range(0, logits.shape[0], _ROWS_PER_PIECE):
            lp = torch.log_softmax(logits[at:at + _ROWS_PER_PIECE].float(), dim=-1)
            c = lp.gather(1, targets[at:at + _ROWS_PER_PIECE].unsqueeze(1))
            chosen.append(c.squeeze(1))
            ranks.append((lp > c).sum(dim=-1) + 1)
            if self.k > 0:
                v, i = lp.topk(min(self.k, lp.shape[1]), dim=-1)  # sorted descending
                top_v.append(v)
                top_i.append(i)
        parts = [torch.cat(chosen), torch.cat(ranks)]
        if self.k > 0:
            parts += [torch.cat(top_v), torch.cat(top_i)]
        self._event = None
        if device.type == "cuda":
            self._host = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True).copy_(p, non_blocking=True)
                          for p in parts]
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(device))
        else:
            self._host = parts

    def land(self) -> None:
        """Wait for them and append each request's new entries in order (skipping
        positions it has already, and requests that finished meanwhile)."""
        if self._event is not None:
            self._event.synchronize()
        chosen, ranks = self._host[0].tolist(), self._host[1].tolist()
        top_v, top_i = (self._host[2].tolist(), self._host[3].tolist()) if self.k > 0 else ([], [])
        row = 0
        for request, first, n in self.spans:
            record = request.prompt_logprobs
            assert record is not None  # plan_rows spans only requests that have one
            have = len(record.entries)
            if request.status.finished:
                row += n
                continue
            if have < first:
                raise EngineStateError(f"request {request.request_id!r}: prompt logprobs for positions "
                                       f"from {first} arrived before those from {have}")
            count = request.sampling_params.prompt_logprobs or 0
            for j in range(have - first, n):
                r = row + j
                top = list(zip(top_i[r][:count], top_v[r][:count])) if count else []
                record.entries.append(TokenLogprobs(
                    request.prompt_token_ids[first + j + 1], chosen[r], top, ranks[r]))
            row += n
