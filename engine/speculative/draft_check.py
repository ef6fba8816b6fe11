"""Whether a draft model can serve a target model (speculative_config.model): checked
before anything loads, by the engine and by `pdserve serve` before any worker starts.
Torch-free."""

from __future__ import annotations

from pathlib import Path

from engine.config import EngineConfig
from engine.model.config import ModelConfig
from engine.tokenizer import has_tokenizer, load_tokenizer


def draft_model_dir(config: EngineConfig) -> str:
    """speculative_config.model, which a draft_model speculator has (SpeculativeConfig
    requires it for that method)."""
    spec = config.speculative_config
    if spec is None or spec.model is None:
        raise ValueError("speculative_config.model: a draft model needs its directory")
    return spec.model


def check_draft(config: EngineConfig, target: ModelConfig, model_len: int) -> ModelConfig:
    """The draft's config, if config.speculative_config.model can draft for the target
    model (config.model, serving model_len tokens): it loads, shares the target's
    vocabulary (size and tokenizer) and reaches model_len positions. Raises
    ValueError naming speculative_config.model and the reason."""
    draft_dir = draft_model_dir(config)
    where = f"speculative_config.model {draft_dir!r}"
    try:
        draft = ModelConfig.from_model_dir(draft_dir)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{where} does not load as a draft model: {load_failure(exc)}") from exc
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"{where} has a vocabulary of {draft.vocab_size} tokens, the target model "
                         f"{target.vocab_size}: a draft must share the target's vocabulary")
    context = draft.max_position_embeddings
    if context < model_len:
        raise ValueError(f"{where} supports {context} positions (its max_position_embeddings), fewer than the target's "
                         f"max_model_len {model_len}: its drafts could not reach the end of a sequence; "
                         f"set max_model_len <= {context}, or use a draft with a longer context")
    mismatch = _tokenizer_mismatch(config.model, draft_dir)
    if mismatch is not None:
        raise ValueError(f"{where}: its tokenizer's vocabulary differs from the target model's ({mismatch}): "
                         "a draft must share the target's vocabulary")
    return draft


def load_failure(exc: BaseException) -> str:
    """Why a model directory did not load, in a sentence."""
    if isinstance(exc, KeyError):  # a field config.json lacks
        return f"its config.json has no {exc.args[0]!r}"
    return str(exc)


def _tokenizer_mismatch(target_dir: str, draft_dir: str) -> str | None:
    """How the two directories' tokenizers map token strings differently; None when
    they agree, or when either directory has no tokenizer (the engine needs none)."""
    if Path(target_dir).resolve() == Path(draft_dir).resolve():
        return None
    if not (has_tokenizer(target_dir) and has_tokenizer(draft_dir)):
        return None
    files = [Path(d) / "tokenizer.json" for d in (target_dir, draft_dir)]
    if all(f.is_file() for f in files) and files[0].read_bytes() == files[1].read_bytes():
        return None  # the same tokenizer: no need to load either
    ours_tokenizer, theirs_tokenizer = load_tokenizer(target_dir), load_tokenizer(draft_dir)
    assert ours_tokenizer is not None and theirs_tokenizer is not None  # has_tokenizer said both have one
    ours, theirs = ours_tokenizer.get_vocab(), theirs_tokenizer.get_vocab()
    differ = sorted(t for t in ours.keys() | theirs.keys() if ours.get(t) != theirs.get(t))
    return f"{len(differ)} token strings have other ids, e.g. {differ[:3]}" if differ else None
