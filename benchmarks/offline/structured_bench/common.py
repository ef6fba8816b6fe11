"""What the sections share: the demo model's vocabulary, a tokenizer, and matchers of
the benchmark schema advanced to chosen positions of the benchmark document."""

from __future__ import annotations

from concurrent.futures import Future

from benchmarks.offline.structured_bench.schema import document_text, schema_text
from engine.model.config import ModelConfig
from engine.structured.compiler import GrammarCompiler
from engine.structured.matcher import GrammarState
from engine.structured.params import StructuredOutputsParams
from engine.tokenizer import load_tokenizer


class Grammars:
    """The schema compiled once against the model's tokenizer, and the document's tokens."""

    def __init__(self, model: str) -> None:
        self.model_config = ModelConfig.from_model_dir(model)
        self.vocab = self.model_config.vocab_size
        self.compiler = GrammarCompiler(model, self.vocab, self.model_config.eos_token_ids)
        self.params = StructuredOutputsParams(json=schema_text())
        self.compiled: Future = self.compiler.compile(self.params)
        self.compiled.result()
        self.tokenizer = load_tokenizer(model)
        self.document = self.tokenizer.encode(document_text(), add_special_tokens=False)

    def state_at(self, position: int) -> GrammarState:
        """A matcher that has accepted the document's first `position` tokens."""
        state = GrammarState(self.compiled)
        state.ready()
        for token in self.document[:position]:
            if not state.accept(token):
                raise RuntimeError(f"the benchmark document's token {token} at {position} is refused by the schema")
        return state

    def spread_states(self, batch: int) -> list[GrammarState]:
        """`batch` matchers at positions spread evenly over the document (row i at
        i * len / batch): starts, keys, strings, numbers, enums, the end."""
        n = len(self.document)
        return [self.state_at(i * n // batch) for i in range(batch)]

    def close(self) -> None:
        self.compiler.close()
