"""Makes an engine's requests: checked against the vocabulary, with their feature
records (a seeded generator, speculation, a grammar, prompt logprobs), one request or
a group (n > 1); and watches the grammars that are still compiling.
"""

from __future__ import annotations

import math
import time
from typing import Any

from engine.builder import EngineResources
from engine.config import EngineConfig
from engine.errors import RequestsFailed
from engine.lora.request import LoRARequest
from engine.model.config import ModelConfig
from engine.request import LoRAUse, Request, Speculation
from engine.sampling import make_generator
from engine.sampling_params import SamplingParams, SamplingParamsError, child_request_id


class RequestFactory:
    """Called by the engine core as a request arrives, before it is queued."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, speculating: bool,
                 resources: EngineResources) -> None:
        self.config = config
        self.model_config = model_config
        self.speculating = speculating
        self.resources = resources  # holds the grammar compiler, made at the first grammar

    def single(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               priority: int = 0, resumed: int = 0, queue_tag: float = 0.0,
               lora: LoRARequest | None = None) -> Request:
        """A request with its feature records; raises ValueError (SamplingParamsError
        naming the parameter) for token ids outside the vocabulary, a bad `resumed` or
        `queue_tag`, a grammar refused at once, or a LoRA adapter that cannot be read.
        `resumed`, `queue_tag`, `lora`: as EngineCore.add_request's."""
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:5]}")
        outside = params.out_of_vocab(vocab)
        if outside is not None:
            raise SamplingParamsError(outside[0], f"token ids must be in [0, {vocab}), got {outside[1]}")
        if not (isinstance(resumed, int) and 0 <= resumed < len(prompt_token_ids)):
            raise ValueError(f"resumed must be in [0, {len(prompt_token_ids)}), got {resumed!r}")
        # A nan would break the queue heaps' order for every request.
        if not (isinstance(queue_tag, (int, float)) and math.isfinite(queue_tag) and queue_tag >= 0):
            raise ValueError(f"queue_tag must be a finite number >= 0, got {queue_tag!r}")
        request = Request(request_id, list(prompt_token_ids), params, priority=priority, queue_tag=queue_tag)
        request.lora = self._lora(lora)
        if params.seed is not None:
            request.generator = make_generator(params.seed, self.config.device)
        if self.speculating:
            request.spec = Speculation()
        if params.structured_outputs is not None:
            request.grammar = self._grammar_state(params, prompt_token_ids[len(prompt_token_ids) - resumed:])
            # A compile that is over (a cache hit, or a description xgrammar refused at
            # once) is judged here, before the request is queued: a ValueError then
            # changes nothing.
            request.grammar.ready()
            error = request.grammar.error()
            if error is not None:
                raise error
            # Each token's mask needs the one before it on the host: no step ahead.
            request.reads_history_until = math.inf
        return request

    def _lora(self, lora: LoRARequest | None) -> LoRAUse | None:
        """The adapter, read now (and kept) so that one that cannot be fails its request
        before it is queued."""
        if lora is None:
            return None
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest or None, got {type(lora).__name__}")
        if self.resources.loras is None:
            raise ValueError(f"lora_request {lora.lora_name!r}: this engine was started without enable_lora")
        return LoRAUse(self.resources.loras.adapter(lora))

    def _grammar_state(self, params: SamplingParams, resumed: list[int]) -> Any:
        from engine.structured.compiler import GrammarCompiler  # imports xgrammar
        from engine.structured.matcher import GrammarState

        if self.resources.grammars is None:
            self.resources.grammars = GrammarCompiler(self.config.model, self.model_config.vocab_size,
                                                      self.model_config.eos_token_ids)
        return GrammarState(self.resources.grammars.compile(params.structured_outputs), resumed)

    def group(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
              priority: int, resumed: int, queue_tag: float = 0.0,
              lora: LoRARequest | None = None) -> tuple[Request, list[Request]]:
        """A group's prompt request (every prompt token but the last, prefill only) and
        its sequences, each checked as single() checks one request (the scheduler's
        check_group checks that they fit)."""
        if params.prompt_logprobs is not None:  # each sequence computes only the last prompt token
            raise SamplingParamsError("prompt_logprobs", "is not supported with n > 1 (ask with n=1)")
        sequences = [self.single(child_request_id(request_id, i), prompt_token_ids, params.child(i),
                                 priority, resumed, queue_tag, lora) for i in range(params.n)]
        prompt = Request(request_id, list(prompt_token_ids[:-1]), SamplingParams(max_tokens=1), priority=priority,
                         queue_tag=queue_tag)
        prompt.prefill_only = True
        prompt.lora = self._lora(lora)
        return prompt, sequences


class GrammarWatch:
    """The requests whose grammar is still compiling. The engine core tracks each
    request it queues and calls check() before every step."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.compiling: dict[str, Request] = {}

    def track(self, request: Request) -> Request:
        if request.grammar_pending:
            self.compiling[request.request_id] = request
        return request

    def wait(self, timeout_s: float) -> None:
        """Nothing else to do: wait a little for one of them."""
        grammar = next(iter(self.compiling.values())).grammar
        assert grammar is not None  # track() keeps only requests whose grammar is compiling
        grammar.wait(timeout_s)

    def check(self) -> None:
        """Forget requests whose grammar has compiled. One whose compile failed is
        reported (RequestsFailed, at its own fault, naming its parameter), one per step
        so that each gets its own message; the caller ends it as it ends any failed
        request (a decode worker first lets a remote KV write into its blocks finish).
        Until then it stays queued, never admitted (it has no matcher)."""
        for request_id, request in list(self.compiling.items()):
            if request.status.finished:  # aborted meanwhile
                del self.compiling[request_id]
                continue
            timeout = self.timeout_s
            grammar = request.grammar
            assert grammar is not None  # track() keeps only requests whose grammar is compiling
            error: BaseException | None
            try:
                if not grammar.ready():
                    if time.monotonic() - grammar.created <= timeout:
                        continue
                    # The compile thread cannot be stopped; it finishes into the cache.
                    error = ValueError(f"its grammar did not compile within {timeout:g} s "
                                       "(engine.grammar_compile_timeout_s): the schema is too large or complex")
                else:
                    error = grammar.error()
            except ValueError as exc:  # its resumed tokens do not follow the grammar
                error = exc
            del self.compiling[request_id]
            if error is not None:
                raise RequestsFailed(str(error), [request_id], at_fault=True,
                                     param=getattr(error, "param", "structured_outputs"))
