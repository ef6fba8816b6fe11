"""The names the served model answers to: what /v1/models lists, which `model` a request
may give, and the model object of GET /v1/models/{id}.

`router.served_model_name` sets them (one name or several aliases); without it the one
name is the model path, and its directory name is accepted too. Responses carry the
first name whatever alias the request gave, as vLLM answers. A request naming another
model is a 404 in OpenAI's shape (code "model_not_found", param "model").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.user_values import show
from router.errors import APIError

OWNER = "pdserve"


@dataclass(frozen=True)
class ServedModels:
    names: tuple[str, ...]  # listed by /v1/models; names[0] is the one responses carry
    accepted: frozenset[str]  # what a request's `model` may be
    max_model_len: int  # in each model object, as vLLM lists it

    @classmethod
    def of(cls, served_model_name: Sequence[str] | None, model_path: str, max_model_len: int) -> ServedModels:
        if served_model_name:
            return cls(tuple(served_model_name), frozenset(served_model_name), max_model_len)
        return cls((model_path,), frozenset({model_path, Path(model_path).name}), max_model_len)

    @property
    def name(self) -> str:
        return self.names[0]

    def check(self, body: dict[str, Any]) -> None:
        """A request body's `model`, if it gives one: 400 if not a string, 404 if no
        name of this model."""
        model = body.get("model")
        if model is None:
            return
        if not isinstance(model, str):
            raise APIError(400, f"model must be a string, got {show(model)}", "model")
        if model not in self.accepted:
            raise self.not_found(model)

    def not_found(self, model: str) -> APIError:
        served = ", ".join(repr(n) for n in self.names)
        return APIError(404, f"model {model!r} is not served here; this server serves {served}", "model",
                        code="model_not_found")

    def listing(self) -> dict[str, Any]:
        """GET /v1/models."""
        return {"object": "list", "data": [self.card(name) for name in self.names]}

    def get(self, model: str) -> dict[str, Any]:
        """GET /v1/models/{model}: its model object, or APIError 404."""
        if model not in self.accepted:
            raise self.not_found(model)
        return self.card(model)

    def card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": OWNER, "max_model_len": self.max_model_len}
