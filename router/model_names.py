"""The names the served model answers to: what /v1/models lists, which `model` a request
may give, and the model object of GET /v1/models/{id}.

`router.served_model_name` sets them (one name or several aliases); without it the one
name is the model path, and its directory name is accepted too. Responses carry the
first name whatever alias the request gave, as vLLM answers. A request may also name a
LoRA adapter served beside the model (router/adapters.py): it runs with it, and its
responses carry the adapter's name; /v1/models lists each adapter with the model as
its `parent`, as vLLM does. A request naming another model is a 404 in OpenAI's shape
(code "model_not_found", param "model").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.model.config import ModelConfig
from engine.user_values import show
from router.adapters import Adapter, Adapters
from router.errors import APIError

OWNER = "pdserve"


@dataclass(frozen=True)
class ServedModels:
    names: tuple[str, ...]  # listed by /v1/models; names[0] is the one responses carry
    accepted: frozenset[str]  # what a request's `model` may be
    max_model_len: int  # in each model object, as vLLM lists it
    root: str = ""  # the model's directory (the model objects' `root`)
    adapters: Adapters = field(default_factory=lambda: Adapters(None, frozenset()))  # LoRA adapters served beside it

    @classmethod
    def of(cls, served_model_name: Sequence[str] | None, model_path: str, max_model_len: int,
           max_lora_rank: int | None = None, adapters: Mapping[str, str] = {}) -> ServedModels:
        """`max_lora_rank`: the workers' (None: no LoRA); `adapters`: name -> PEFT
        directory, served from the start (ValueError naming one that cannot be)."""
        names = tuple(served_model_name) if served_model_name else (model_path,)
        accepted = frozenset(served_model_name) if served_model_name else frozenset({model_path,
                                                                                       Path(model_path).name})
        model = ModelConfig.from_model_dir(model_path) if max_lora_rank is not None else None
        return cls(names, accepted, max_model_len, model_path, Adapters(max_lora_rank, accepted, adapters, model))

    @property
    def name(self) -> str:
        return self.names[0]

    def check(self, body: dict[str, Any]) -> Adapter | None:
        """A request body's `model`, if it gives one: 400 if not a string, 404 if no
        name of this model nor of an adapter served; the adapter it names, if one."""
        model = body.get("model")
        if model is None:
            return None
        if not isinstance(model, str):
            raise APIError(400, f"model must be a string, got {show(model)}", "model")
        if model in self.accepted:
            return None
        adapter = self.adapters.get(model)
        if adapter is None:
            raise self.not_found(model)
        return adapter

    def not_found(self, model: str) -> APIError:
        served = ", ".join(repr(n) for n in self.names)
        if len(self.adapters):
            served += f" and {len(self.adapters)} LoRA adapters (GET /v1/models lists them)"
        return APIError(404, f"model {model!r} is not served here; this server serves {served}", "model",
                        code="model_not_found")

    def listing(self) -> dict[str, Any]:
        """GET /v1/models."""
        return {"object": "list", "data": [self.card(name) for name in self.names]
                + [self._adapter_card(adapter) for adapter in self.adapters]}

    def get(self, model: str) -> dict[str, Any]:
        """GET /v1/models/{model}: its model object, or APIError 404."""
        if model in self.accepted:
            return self.card(model)
        adapter = self.adapters.get(model)
        if adapter is None:
            raise self.not_found(model)
        return self._adapter_card(adapter)

    def card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": OWNER, "root": self.root, "parent": None,
                "max_model_len": self.max_model_len}

    def _adapter_card(self, adapter: Adapter) -> dict[str, Any]:
        return {**self.card(adapter.name), "root": adapter.path, "parent": self.name}
