"""Offline colocated engine: LLM(model=...).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any, cast

from tqdm import tqdm

from engine.config import EngineConfig
from engine.engine_core import EngineCore, EngineStats
from engine.lora.request import LoRARequest
from engine.output_processor import OutputProcessor, RequestOutput
from engine.sampling_params import SamplingParams
from engine.speculative.metrics import Metric, spec_decode_metrics
from engine.tokenizer import load_tokenizer

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    """Options are EngineConfig fields; an unknown option is a ValueError naming it."""

    def __init__(self, model: str, **options: Any) -> None:
        self.config = EngineConfig.from_options(model, **options)
        self.core = EngineCore(self.config)
        self.tokenizer = load_tokenizer(model)
        self.outputs = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def _tokenize(self, prompt: Prompt, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; this model directory has none "
                                 "(pass token id lists instead)")
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        return None, list(prompt)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. `lora_request`: the
        LoRA adapter of every prompt, or one per prompt (None: the base model); the
        engine needs enable_lora=True.

        Bad input (any prompt or parameter) raises ValueError before anything runs, and
        the engine stays usable.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        batch = cast("Sequence[Prompt]", prompts)  # cast: one prompt was wrapped just above
        return self._generate([self._tokenize(p) for p in batch], sampling_params, use_tqdm, priority, lora_request)

    def _generate(self, tokenized: list[tuple[str | None, list[int]]],
                  sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                  use_tqdm: bool, priority: Sequence[int] | None,
                  lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = list(params) if isinstance(params, Sequence) else [params] * len(tokenized)
        if len(params) != len(tokenized):
            raise ValueError(f"got {len(params)} SamplingParams for {len(tokenized)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(tokenized)
        if len(priorities) != len(tokenized):
            raise ValueError(f"got {len(priorities)} priorities for {len(tokenized)} prompts")
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(tokenized)
        if len(loras) != len(tokenized):
            raise ValueError(f"got {len(loras)} lora_requests for {len(tokenized)} prompts")
        if self.tokenizer is None and any(p.stop for p in params):
            raise ValueError("stop strings need a tokenizer; this model directory has none")
        params = [self._tokenize_bad_words(p) for p in params]
        for (_, ids), p in zip(tokenized, params):
            self.core.scheduler.check_fits(len(ids), p.max_tokens)
        _check_grammars(params)

        order: list[list[str]] = []  # per prompt, its sequences' request ids (n of them)
        try:
            for (text, ids), p, prio, lora in zip(tokenized, params, priorities, loras):
                request = self.core.add_request(f"offline-{next(self._ids)}", ids, p, prio, lora_request=lora)
                sequences = request.sequences if request.sequences is not None else [request]
                order.append([r.request_id for r in sequences])
                for sequence in sequences:
                    self.outputs.add(sequence, text)
        except Exception:
            self._abort([r for ids in order for r in ids])
            raise
        return self._run(order, use_tqdm)

    def _tokenize_bad_words(self, params: SamplingParams) -> SamplingParams:
        """The engine reads bad words as token sequences (bad_words_token_ids)."""
        if not params.bad_words:
            return params
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise ValueError("bad_words need a tokenizer; this model directory has none "
                             "(pass bad_words_token_ids instead)")
        return params.with_bad_words_tokenized(lambda word: tokenizer.encode(word, add_special_tokens=False))

    def _run(self, order: list[list[str]], use_tqdm: bool) -> list[RequestOutput]:
        """One RequestOutput per prompt; with n > 1 it is sequence 0's, and its
        `sequences` hold all n."""
        done: dict[str, RequestOutput] = {}
        every = [r for ids in order for r in ids]
        bar = tqdm(total=len(every), desc="generate", unit="seq" if len(every) > len(order) else "req",
                   disable=not use_tqdm)
        try:
            while self.core.has_unfinished():
                step = self.core.step()
                finished = step.finished
                stopped = self.outputs.check_stop_strings(step.advanced)
                if stopped:
                    finished = finished + self.core.finish_stopped(stopped)
                for request in finished:
                    done[request.request_id] = self.outputs.finish(request)
                bar.update(len(finished))
        except BaseException:
            self._abort(every)  # leave the engine usable: nothing half-run stays queued
            raise
        finally:
            bar.close()
        return [done[ids[0]] if len(ids) == 1 else dataclasses.replace(done[ids[0]], sequences=[done[r] for r in ids])
                for ids in order]

    def _abort(self, request_ids: list[str]) -> None:
        for request in self.core.abort(request_ids):
            self.outputs.discard(request.request_id)

    def stats(self) -> EngineStats:
        """The engine's figures now: KV blocks, queues, preemptions so far, and with a
        speculative_config `spec` (SpecStats: drafts, accepted tokens, per position,
        acceptance_rate, mean_accepted_length), counted since the LLM was made."""
        return self.core.stats()

    def get_metrics(self) -> list[Metric]:
        """Speculative decoding's counters in the shapes of vLLM's LLM.get_metrics()
        (Counter, Vector), named as the router's /metrics names them
        (engine/speculative/metrics.py); [] without a speculative_config. vLLM's other
        metrics (latencies, token counts) are not kept offline."""
        spec = self.core.stats().spec
        return spec_decode_metrics(spec) if spec is not None else []

    def chat(self, messages: list[Message] | Sequence[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """One conversation or a list of them, through the model's chat template."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; use generate()")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        # The template already holds any BOS token: don't let encode() add a second.
        tokenized = [self._tokenize(self.tokenizer.apply_chat_template(
            c, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
            for c in conversations]
        return self._generate(tokenized, sampling_params, use_tqdm, None)


def _check_grammars(params: list[SamplingParams]) -> None:
    """A grammar xgrammar refuses is a ValueError naming its key here, before anything
    runs (the engine compiles them in the background, where it would fail a step)."""
    specs = {p.structured_outputs.key: p.structured_outputs for p in params if p.structured_outputs is not None}
    if specs:
        from engine.structured.grammar import build_grammar  # imports xgrammar

        for spec in specs.values():
            build_grammar(spec)
