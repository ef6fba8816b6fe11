"""Token ids -> text, stop strings, and the user-facing RequestOutput.

Stop strings need text, and the engine core speaks only token ids, so they are found
here; the caller then finishes the request in the core so its blocks are freed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.request import Request, RequestStatus
from engine.sampling import TokenLogprobs


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort"; None while running
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass
class _State:
    prompt: str | None
    stop: list[str]
    include_stop: bool
    text: str = ""
    stopped: bool = False  # a stop string was found; text is final
    checked_upto: int = 0  # text before this index holds no stop string


class OutputProcessor:
    """Called by the front end (offline LLM or router) after every engine step."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _State] = {}
        self._num_with_stop = 0  # requests with stop strings not yet found: most steps have none

    def add(self, request: Request, prompt: str | None) -> None:
        params = request.sampling_params
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model directory has none")
        self._states[request.request_id] = _State(prompt, params.stop, params.include_stop_str_in_output)
        self._num_with_stop += bool(params.stop)

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def check_stop_strings(self, advanced: list[Request]) -> list[str]:
        """Ids of requests whose text now contains a stop string (to be finished)."""
        hits: list[str] = []
        if not self._num_with_stop:
            return hits
        for request in advanced:
            state = self._states[request.request_id]
            if not state.stop or state.stopped:
                continue
            state.text = self.decode(request.output_token_ids)
            if request.num_output_tokens < request.sampling_params.min_tokens:
                state.checked_upto = len(state.text)  # as vLLM: no stop before min_tokens
                continue
            cut = self._find_stop(state)
            if cut is not None:
                state.text, state.stopped = state.text[:cut], True
                self._num_with_stop -= 1
                hits.append(request.request_id)
        return hits

    @staticmethod
    def _find_stop(state: _State) -> int | None:
        """End of the kept text if a stop string occurs in text not yet checked."""
        # A stop string may straddle the old/new boundary: look back len(stop) - 1 chars.
        lookback = max(len(s) for s in state.stop) - 1
        begin = max(0, state.checked_upto - lookback)
        best = None
        for stop in state.stop:
            i = state.text.find(stop, begin)
            if i != -1 and (best is None or i < best[0]):
                best = (i, i + len(stop) if state.include_stop else i)
        # The tail may still grow into a stop string (or end in a partial UTF-8 char).
        state.checked_upto = len(state.text)
        return None if best is None else best[1]

    def discard(self, request_id: str) -> None:
        self._forget(request_id)

    def _forget(self, request_id: str) -> _State | None:
        state = self._states.pop(request_id, None)
        if state is not None and state.stop and not state.stopped:
            self._num_with_stop -= 1
        return state

    def finish(self, request: Request) -> RequestOutput:
        state = self._forget(request.request_id)
        if state is None:
            raise KeyError(f"finish() of a request never added: {request.request_id!r}")
        if state.stopped:
            text, reason = state.text, RequestStatus.FINISHED_STOPPED.value
        else:
            text, reason = self.decode(request.output_token_ids), request.status.value
        logprobs = request.output_logprobs if request.sampling_params.logprobs is not None else None
        return RequestOutput(request.request_id, state.prompt, request.prompt_token_ids,
                             list(request.output_token_ids), text, reason, logprobs,
                             request.num_cached_tokens)
