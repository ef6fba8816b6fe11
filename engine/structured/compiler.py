"""Compiling grammars off the step path: a thread pool, and a cache keyed by grammar.

The first structured request of an engine loads the model directory's tokenizer (its
vocabulary is what a grammar is compiled against); every request then gets a Future of
its compiled grammar, shared by requests with the same description. Compiles run in
worker threads (xgrammar releases the GIL while compiling), so the engine keeps stepping
while a request waits for its own grammar.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

from engine.structured.grammar import build_grammar
from engine.structured.params import StructuredOutputsError, StructuredOutputsParams
from engine.tokenizer import load_tokenizer

# Compiled grammars kept for reuse (a JSON schema's is tens of KB to a few MB).
CACHE_ENTRIES = 256


class GrammarCompiler:
    """One per engine. compile() never blocks on a compile."""

    def __init__(self, model_dir: str, vocab_size: int, stop_token_ids: Sequence[int],
                 threads: int = 2, cache_entries: int = CACHE_ENTRIES) -> None:
        """vocab_size: the model's (its logits' width), which may exceed the tokenizer's;
        stop_token_ids: what ends a request (a completed grammar allows only these)."""
        self.model_dir, self.vocab_size = model_dir, vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str, bool], Future] = OrderedDict()
        self._cache_entries = cache_entries
        self._lock = threading.Lock()  # the tokenizer's lazy load, from the pool's threads
        self._compiler: xgr.GrammarCompiler | None = None

    def compile(self, params: StructuredOutputsParams) -> Future:
        """A Future of the xgrammar CompiledGrammar; it raises StructuredOutputsError
        (the description's fault) or RuntimeError (no tokenizer) when the compile fails.
        A failed compile is not cached."""
        key = params.key
        future = self._cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
            return future
        future = self._pool.submit(self._compile, params)
        self._cache[key] = future
        while len(self._cache) > self._cache_entries:
            self._cache.popitem(last=False)
        return future

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        grammar = build_grammar(params)
        compiler = self._xgr_compiler()
        try:
            return compiler.compile_grammar(grammar)
        except Exception as exc:  # noqa: BLE001 - whatever xgrammar raises, it is this description's
            raise StructuredOutputsError(f"structured_outputs.{params.kind}", f"cannot be compiled: {exc}") from None

    def _xgr_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                tokenizer = load_tokenizer(self.model_dir)
                if tokenizer is None:
                    raise StructuredOutputsError("structured_outputs", "needs the model's tokenizer, and "
                                                 f"{self.model_dir} has none")
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                # Our cache holds the compiled grammars; xgrammar's own would be a second copy.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def close(self) -> None:
        """Drop queued compiles; one running finishes in its thread."""
        self._pool.shutdown(wait=False, cancel_futures=True)
