"""`lora`: LoRA adapters served beside the model, set once for every worker of both
pools (a prefill worker computes a LoRA request's prompt KV with its adapter too);
docs/configs.md has a row per field.

    lora:
      adapters: {sql: adapters/sql-lora, chat: /srv/adapters/chat}   # name -> PEFT directory
      max_loras: 4          # adapters in one batch (each worker's slots)
      max_lora_rank: 16     # the largest rank an adapter may have
      max_cpu_loras: 8      # adapters each worker keeps read in host memory (null: max_loras)

The section turns LoRA on (with no adapters, the admin endpoint loads them at runtime).
Each adapter is checked where the config loads: its files PEFT's, its rank within
max_lora_rank, its name not the model's. Its path must be readable there and, under the
same path, on every worker's node (as the model's is).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from cluster.config_fields import ConfigError, check, checked_mapping, integer
from engine.lora.files import check_adapter, declared_rank, name_problem, read_files
from engine.model.config import ModelConfig

# The engine options the section sets on every pool (refused in <pool>.engine).
ENGINE_FIELDS = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")


@dataclass(frozen=True)
class LoRAConfig:
    adapters: dict[str, str] = field(default_factory=dict)
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    @classmethod
    def from_dict(cls, data: Any, path: str = "lora", model: str | None = None) -> LoRAConfig | None:
        """None: no section (LoRA off). `model`: the model directory, which each adapter
        must fit when its config.json is readable here."""
        if data is None:
            return None
        data = checked_mapping(cls, data, path)
        out = cls(**data)
        integer(out.max_loras, f"{path}.max_loras", 1)
        integer(out.max_lora_rank, f"{path}.max_lora_rank", 1)
        if out.max_cpu_loras is not None:
            integer(out.max_cpu_loras, f"{path}.max_cpu_loras", out.max_loras)
        fits = ModelConfig.from_model_dir(model) if model is not None and os.path.isfile(
            os.path.join(model, "config.json")) else None
        for name, directory in out.adapters.items():
            where = f"{path}.adapters.{name}"
            problem = name_problem(name)
            check(problem is None, f"{path}.adapters", f"an adapter's name {problem}")
            check(isinstance(directory, str) and directory != "", where,
                  f"must be the adapter's PEFT directory, got {directory!r}")
            try:
                if fits is not None:
                    check_adapter(name, directory, fits, out.max_lora_rank)
                elif (rank := declared_rank(read_files(name, directory)[0])) > out.max_lora_rank:
                    raise ValueError(f"has rank {rank}, above max_lora_rank {out.max_lora_rank}")
            except ValueError as exc:
                raise ConfigError(f"{where}: {exc}".replace("max_lora_rank", f"{path}.max_lora_rank")) from None
        # Absolute: the router and every worker resolve them alike, whatever their directory.
        return dataclasses.replace(out, adapters={n: os.path.abspath(d) for n, d in out.adapters.items()})

    def engine_options(self) -> dict[str, Any]:
        return {"enable_lora": True, "max_loras": self.max_loras, "max_lora_rank": self.max_lora_rank,
                "max_cpu_loras": self.max_cpu_loras}
