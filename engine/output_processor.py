"""Token ids -> text, stop strings, and the user-facing RequestOutput.

Stop strings need text, and the engine core speaks only token ids, so they are found
here; the caller then finishes the request in the core so its blocks are freed. The
text and the stop rules are engine/detokenizer.py's, the router's too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.detokenizer import Detokenizer
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
    # n > 1: every sequence's output, sequence i at index i (the fields above are
    # sequence 0's); empty for n = 1.
    sequences: list[RequestOutput] = field(default_factory=list)
    # params.prompt_logprobs: one per prompt token, None for the first (vLLM's shape
    # but TokenLogprobs entries: the prompt token, its logprob and rank, the top ones)
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class _State:
    prompt: str | None
    detok: Detokenizer | None  # None without a tokenizer: the text is ""


class OutputProcessor:
    """Called by the front end (offline LLM) after every engine step.

    A request with stop strings is detokenized as its tokens come; one without is
    decoded once, when it finishes (most steps have no stop string to look for)."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _State] = {}
        self._num_with_stop = 0  # requests with stop strings not yet found

    def add(self, request: Request, prompt: str | None) -> None:
        params = request.sampling_params
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model directory has none")
        detok = None if self.tokenizer is None else Detokenizer.for_params(self.tokenizer, params)
        self._states[request.request_id] = _State(prompt, detok)
        self._num_with_stop += bool(params.stop)

    def check_stop_strings(self, advanced: list[Request]) -> list[str]:
        """Ids of requests whose text now contains a stop string (to be finished)."""
        hits: list[str] = []
        if not self._num_with_stop:
            return hits
        for request in advanced:
            detok = self._states[request.request_id].detok
            if detok is None or not detok.stop or detok.stopped:
                continue
            if detok.add(request.output_token_ids[detok.num_tokens:])[1]:
                self._num_with_stop -= 1
                hits.append(request.request_id)
        return hits

    def discard(self, request_id: str) -> None:
        self._forget(request_id)

    def _forget(self, request_id: str) -> _State | None:
        state = self._states.pop(request_id, None)
        if state is not None and state.detok is not None and state.detok.stop and not state.detok.stopped:
            self._num_with_stop -= 1
        return state

    def finish(self, request: Request) -> RequestOutput:
        state = self._forget(request.request_id)
        if state is None:
            raise KeyError(f"finish() of a request never added: {request.request_id!r}")
        text, reason = "", request.status.value
        token_ids, logprobs = list(request.output_token_ids), request.output_logprobs
        if (detok := state.detok) is not None:
            if not detok.stopped:
                detok.add(request.output_token_ids[detok.num_tokens:])
                detok.flush()
            text = detok.text
            if detok.stopped:
                reason = RequestStatus.FINISHED_STOPPED.value
                # A speculative step may have taken tokens after the one that completed
                # the stop string: the output ends at that one, as without drafts.
                token_ids, logprobs = token_ids[:detok.num_tokens], logprobs[:detok.num_tokens]
        wanted = logprobs if request.sampling_params.logprobs is not None else None
        prompt_logprobs = None
        if request.prompt_logprobs is not None:
            prompt_logprobs = [None, *request.prompt_logprobs.entries]
        return RequestOutput(request.request_id, state.prompt, request.prompt_token_ids,
                             token_ids, text, reason, wanted,
                             request.num_cached_tokens, prompt_logprobs=prompt_logprobs)
