"""A step's sampled tokens on their way from the device to the host.

The sampler queues its work and these copies without waiting for the device; the
engine waits for them later (`PendingSample.result()`), possibly after queueing the next
step (async scheduling, engine/engine_core.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class UnusableLogitsError(RuntimeError):
    """Some rows' logits could not be sampled (NaN, +inf, or every token -inf)."""

    def __init__(self, message: str, rows: list[int]) -> None:
        super().__init__(message)
        self.rows = rows  # batch rows, in the sampler's row order


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # top-`params.logprobs` (token_id, logprob), descending
    rank: int | None = None  # prompt logprobs: the token's rank in its distribution (1 = most likely)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None
    accepted: list[bool] | None = None  # speculative decoding: per row, its draft was accepted


def small_tensor(device: torch.device, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A small host list as a device tensor, without waiting for the device: a plain
    torch.tensor(..., device="cuda") waits for every kernel queued before it."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class LogprobsQuery:
    rows: list[int]  # batch rows that asked
    counts: list[int]  # top-n each asked for
    logprobs: torch.Tensor | None  # [len(rows), vocab] on the device, until PendingSample reads it
    k: int  # the largest count


class PendingSample:
    """The sampled tokens of one step, on their way to the host.

    `token_ids` stay on the device (a next step scheduled before this one finished reads
    its input ids from them). Their host copies are queued behind the sampling kernels
    into pinned memory, with an event after them, so `result()` waits for this step
    only, even when later steps are already queued on the same stream.
    """

    def __init__(self, token_ids: torch.Tensor, bad: torch.Tensor, query: LogprobsQuery | None,
                 accepted: torch.Tensor | None = None) -> None:
        self.token_ids = token_ids
        device = token_ids.device
        columns: tuple[torch.Tensor, ...] = (token_ids, bad.to(token_ids.dtype))
        if accepted is not None:
            columns += (accepted.to(token_ids.dtype),)
        parts = [torch.stack(columns)]
        self._query = query
        if query is not None:
            logprobs = query.logprobs
            assert logprobs is not None  # read once, here, by the step that computed them
            chosen_ids = token_ids.index_select(0, small_tensor(device, query.rows))
            parts.append(logprobs.gather(1, chosen_ids.unsqueeze(1)).squeeze(1))
            if query.k > 0:
                parts.extend(logprobs.topk(query.k, dim=-1))  # sorted descending
            query.logprobs = None  # [rows, vocab]: not kept alive while the next step runs
        self._event = None
        if device.type == "cuda":
            self._host = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True).copy_(p, non_blocking=True)
                          for p in parts]
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(device))  # the logits' device, not the current one
        else:
            self._host = parts

    def result(self) -> SamplerOutput:
        """Wait for this step's tokens and return them; raises UnusableLogitsError for
        rows whose logits could not be sampled (NaN, +inf, or every token -inf)."""
        if self._event is not None:
            self._event.synchronize()
        token_list, bad_list, *accepted = self._host[0].tolist()
        if any(bad_list):
            rows = [i for i, b in enumerate(bad_list) if b]
            raise UnusableLogitsError(
                f"sampler got unusable logits in batch rows {rows}: NaN, +inf, or every token "
                "-inf (after token controls, penalties and min_tokens masking); nothing can be "
                "sampled", rows)
        logprobs: list[TokenLogprobs | None] = [None] * len(token_list)
        query = self._query
        if query is not None:
            chosen = self._host[1].tolist()
            top_v, top_i = ((self._host[2].tolist(), self._host[3].tolist()) if query.k > 0
                            else ([[]] * len(query.rows), [[]] * len(query.rows)))
            for j, (i, n) in enumerate(zip(query.rows, query.counts)):
                logprobs[i] = TokenLogprobs(token_list[i], chosen[j], list(zip(top_i[j][:n], top_v[j][:n])))
        return SamplerOutput(token_list, logprobs, [bool(a) for a in accepted[0]] if accepted else None)
