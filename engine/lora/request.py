"""What a request names to be run with a LoRA adapter: vLLM's LoRARequest, by name."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter: its name (what the OpenAI API's `model` names), an integer id unique
    per adapter (vLLM's; > 0), and its PEFT directory. `digest`: of its files as the
    caller read them (engine/lora/files.py; the router's): the engine runs the request
    only with a read of those very files (it reads them again if its own read is of
    others, and refuses the request if they changed since); None: whatever they hold."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    digest: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a directory path, got {self.lora_path!r}")
