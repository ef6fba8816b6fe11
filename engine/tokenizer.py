"""A model directory's Hugging Face tokenizer, loaded without importing torch.

transformers' AutoTokenizer imports torch whenever torch is installed (its model-config
classes do), and the router, which runs no model, would carry torch in memory for it.
So for the model types pdserve serves, the class AutoTokenizer would choose is picked
here from the directory's tokenizer_config.json and config.json, and loaded directly;
any other directory falls back to AutoTokenizer itself. The invariant: the tokenizer is
of the class AutoTokenizer returns, loaded from the same files
(tests/unit/test_router_torch_free.py compares them).
"""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path
from typing import Any

# tokenizer_config.json classes that mean "the tokenizers library's tokenizer.json, as is"
_GENERIC = ("TokenizersBackend", "PreTrainedTokenizerFast")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def has_tokenizer(model_dir: str) -> bool:
    """Whether the directory ships a tokenizer (one of TOKENIZER_FILES)."""
    return any((Path(model_dir) / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(model_dir: str) -> Any | None:
    """The directory's Hugging Face tokenizer, or None if it ships none."""
    if not has_tokenizer(model_dir):
        return None
    name = tokenizer_class_name(Path(model_dir))
    if name is None:
        from transformers import AutoTokenizer  # imports torch where it is installed

        return AutoTokenizer.from_pretrained(model_dir)
    import transformers  # its tokenizer classes load lazily, without torch

    return getattr(transformers, name).from_pretrained(model_dir)


def tokenizer_class_name(path: Path) -> str | None:
    """The class AutoTokenizer (transformers 5) picks for this directory, where that is
    known without its torch-importing config machinery; None otherwise.

    With a tokenizer.json, no remote code and a model type pdserve serves:
    - qwen2 gets its registered Qwen2Tokenizer whatever tokenizer_config.json declares
      (transformers lists qwen2 among checkpoints whose declared class is wrong);
    - a declared generic class gets TokenizersBackend (llama, qwen3, olmo2, phi3, gemma2,
      gemma3_text, and mistral unless the directory is in Mistral's own format,
      tekken.json, and mistral-common is installed, when AutoTokenizer prefers
      MistralCommonBackend);
    - qwen3 declaring Qwen2Tokenizer (as Qwen3 checkpoints do) gets Qwen2Tokenizer.
    """
    try:
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None
    if not (path / "tokenizer.json").is_file() or "auto_map" in tokenizer_config:
        return None
    declared = tokenizer_config.get("tokenizer_class")
    if not isinstance(declared, str):
        return None
    declared = declared if declared == "PreTrainedTokenizerFast" else declared.removesuffix("Fast")
    if model_type == "qwen2" and (declared in _GENERIC or declared == "Qwen2Tokenizer"):
        return "Qwen2Tokenizer"
    if model_type == "qwen3" and declared == "Qwen2Tokenizer":
        return "Qwen2Tokenizer"
    mistral_format = (path / "tekken.json").is_file() and find_spec("mistral_common") is not None
    if declared in _GENERIC and (model_type in ("llama", "qwen3", "olmo2", "phi3", "gemma2", "gemma3_text")
                                 or (model_type == "mistral" and not mistral_format)):
        return "TokenizersBackend"
    return None
