"""Structured outputs: requests whose tokens must follow a grammar (a JSON schema, any
JSON object, a regex, a choice of strings, an EBNF grammar or a structural tag).

`params` is the request-side description, importable without xgrammar (the router and
the wire use it). `grammar` turns it into an xgrammar Grammar; `compiler` compiles that
against the model's tokenizer off the step path; `matcher` is one request's state; the
sampler masks each constrained row with its matcher's bitmask (`bitmask`).
"""

from engine.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
