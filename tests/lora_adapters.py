"""Tiny PEFT LoRA adapters of random weights for a tiny model (tests/tiny_models.py):
three of different ranks and targets, saved as PEFT saves them."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.lora.files import read_files
from engine.lora.request import LoRARequest
from protocol import LoRASpec

# name -> (int id, PEFT LoraConfig options)
ADAPTERS: dict[str, tuple[int, dict]] = {
    "a1": (1, dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])),
    "a2": (2, dict(r=8, lora_alpha=16, use_rslora=True,
                   target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])),
    "a3": (3, dict(r=16, lora_alpha=8, target_modules=["gate_proj", "down_proj", "o_proj"])),
}


def make_adapter(base: Path, out: Path, seed: int, **options: object) -> Path:
    """A PEFT adapter of random weights (PEFT starts B at zero: no effect)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), LoraConfig(**options))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    model.save_pretrained(out)
    return out


def spec_of(r: LoRARequest) -> LoRASpec:
    """What a Generate carries for `r`: its fields and its files' digest, as the router reads them."""
    return LoRASpec(name=r.lora_name, id=r.lora_int_id, path=r.lora_path, digest=read_files(r.lora_name, r.lora_path)[2])


def build_adapters(base: Path, root: Path) -> dict[str, LoRARequest]:
    """ADAPTERS for the model at `base`, under root/<name>, as LoRARequests."""
    return {name: LoRARequest(name, i, str(make_adapter(base, root / name, i, **options)))
            for name, (i, options) in ADAPTERS.items()}
