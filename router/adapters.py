"""The LoRA adapters the router serves beside the base model, by name: those of the
config's `lora.adapters`, and those loaded and unloaded at runtime by the admin
endpoints in vLLM's shape (POST /v1/load_lora_adapter {"lora_name", "lora_path"},
POST /v1/unload_lora_adapter {"lora_name"}; admin keys only, router/http_guard.py).

The router never loads an adapter's tensors: a request naming one carries its name, id,
path and files' digest to the workers (protocol/worker.py LoRASpec), and each worker
reads it the first time a request needs it (engine/lora/slots.py). The router reads
the files once per load, without torch (engine/lora/files.py check_adapter): to refuse
an adapter no worker could serve (not PEFT's format, tensors that do not fit the model,
a rank above lora.max_lora_rank) with a 400 now rather than a failed request later;
for the digest, which a worker checks its own read against (files changed since are
refused, never run: a prefill and a decode worker never compute one request with
different weights); and for the prefix-cache root that follows from it, which the
kv_aware index needs to hash a prompt's blocks as the engines do.

An unloaded adapter is no longer served: requests naming it get 404. Its requests in
flight finish with it (they carry its path and digest); each worker drops its read of
the files in its own time (least recently used). Ids are never reused. A name loaded
again from changed files (load_inplace) has another digest: workers read the files
again for its requests, and its blocks chain from another root.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from engine.lora.files import cache_root, check_adapter, name_problem
from engine.model.config import ModelConfig
from protocol import LoRASpec
from router.errors import APIError

# vLLM's paths. They need an admin key, as every /admin/ path does (router/http_guard.py).
LOAD_LORA, UNLOAD_LORA = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
ADMIN_PATHS = frozenset({LOAD_LORA, UNLOAD_LORA})


@dataclass(frozen=True)
class Adapter:
    name: str
    id: int  # unique among every adapter this router ever served
    path: str  # absolute: the workers resolve it in their own working directories
    digest: int  # of its files as the router read them

    @property
    def root(self) -> int:
        """Its blocks' prefix-cache root (engine/lora/files.py cache_root)."""
        return cache_root(self.name, self.digest)

    @property
    def spec(self) -> LoRASpec:
        return LoRASpec(name=self.name, id=self.id, path=self.path, digest=self.digest)


class Adapters:
    """The adapters served, by name. `max_rank`: the workers' lora.max_lora_rank (None:
    the workers run without LoRA, and none can be loaded); `reserved`: the base model's
    names, which no adapter may take; `model`: its config, which adapters must fit."""

    def __init__(self, max_rank: int | None, reserved: frozenset[str], configured: Mapping[str, str] = {},
                 model: ModelConfig | None = None) -> None:
        self.max_rank, self.reserved, self.model = max_rank, reserved, model
        self._by_name: dict[str, Adapter] = {}
        self._ids = itertools.count(1)
        for name, path in configured.items():
            self.load(name, path)

    def __iter__(self) -> Iterator[Adapter]:
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)

    def get(self, name: str) -> Adapter | None:
        return self._by_name.get(name)

    def load(self, name: str, path: str, replace: bool = False) -> Adapter:
        """Read and check the adapter's files and serve it as `name`; ValueError naming
        what is wrong. `replace`: a name already served is served from these files from
        now on (vLLM's load_inplace); else that is an error."""
        self.check_name(name, replace)
        path = os.path.abspath(path)
        return self.add(name, path, self.read(name, path), replace)

    def check_name(self, name: str, replace: bool) -> None:
        if self.max_rank is None or self.model is None:
            raise ValueError("LoRA is off in this deployment: set the config's lora section to serve adapters")
        problem = name_problem(name)
        if problem is not None:
            raise ValueError(f"lora_name {problem}")
        if name in self.reserved:
            raise ValueError(f"lora_name {name!r} is the base model's name")
        if name in self._by_name and not replace:
            raise ValueError(f"lora_name {name!r}: that adapter is already loaded (unload it first, or set "
                             "load_inplace)")

    def read(self, name: str, path: str) -> int:
        """The adapter's files checked against the model (ValueError naming the
        problem); their digest. Touches nothing of this registry: it may run in
        another thread."""
        assert self.max_rank is not None and self.model is not None  # check_name refused it
        return check_adapter(name, path, self.model, self.max_rank)

    def add(self, name: str, path: str, digest: int, replace: bool) -> Adapter:
        """Serve what read() checked (check_name again first: the event loop went on meanwhile)."""
        self.check_name(name, replace)
        adapter = Adapter(name, next(self._ids), path, digest)
        self._by_name[name] = adapter
        return adapter

    def unload(self, name: str) -> Adapter:
        """Stop serving `name`; KeyError if it is not served."""
        return self._by_name.pop(name)


def _body(raw: bytes, fields: dict[str, type]) -> dict[str, Any]:
    """The JSON object of a load/unload request, its fields of the types given."""
    try:
        data = json.loads(raw or b"null")
    except RecursionError:
        raise APIError(400, "the body is not JSON: nested too deeply") from None
    except ValueError as exc:
        raise APIError(400, f"the body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object with {', '.join(fields)}")
    unknown = sorted(set(data) - set(fields) - {"lora_int_id"})  # vLLM's clients may send an id: ours are assigned
    if unknown:
        raise APIError(400, f"unknown field {unknown[0]!r}; this request takes {', '.join(fields)}", unknown[0])
    for key, kind in fields.items():
        if kind is bool:
            if not isinstance(data.get(key, False), bool):
                raise APIError(400, f"{key} must be a boolean, got {data[key]!r}", key)
        elif not isinstance(data.get(key), kind) or not data[key]:
            raise APIError(400, f"{key} is required: a non-empty string", key)
    return data


async def load_endpoint(adapters: Adapters, raw: bytes) -> str:
    """POST /v1/load_lora_adapter: vLLM's answer text, or APIError 400 naming the problem."""
    data = _body(raw, {"lora_name": str, "lora_path": str, "load_inplace": bool})
    name, path, replace = data["lora_name"], os.path.abspath(data["lora_path"]), data.get("load_inplace", False)
    try:
        adapters.check_name(name, replace)
    except ValueError as exc:
        raise APIError(400, str(exc), "lora_name") from None
    try:  # reading the files may take a while: off the event loop
        digest = await asyncio.to_thread(adapters.read, name, path)
    except ValueError as exc:
        raise APIError(400, str(exc), "lora_path") from None
    try:
        adapters.add(name, path, digest, replace)
    except ValueError as exc:  # another request loaded the name meanwhile
        raise APIError(400, str(exc), "lora_name") from None
    return f"Success: LoRA adapter '{name}' added successfully."


def unload_endpoint(adapters: Adapters, raw: bytes) -> str:
    """POST /v1/unload_lora_adapter: vLLM's answer text; 404 if the name is not served."""
    name = _body(raw, {"lora_name": str})["lora_name"]
    try:
        adapters.unload(name)
    except KeyError:
        raise APIError(404, f"the LoRA adapter {name!r} is not loaded", "lora_name") from None
    return f"Success: LoRA adapter '{name}' removed successfully."
