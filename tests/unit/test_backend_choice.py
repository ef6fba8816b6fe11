"""Which attention backend the engine picks, and the names config accepts."""

from __future__ import annotations

import pytest

from engine.attention.backend import BACKENDS, get_backend
from engine.config import ATTENTION_BACKENDS


def test_config_accepts_exactly_the_registered_backends() -> None:
    assert set(ATTENTION_BACKENDS) == set(BACKENDS) | {"auto"}


def test_auto_is_torch_on_cpu() -> None:
    assert get_backend("auto", "cpu").name == "torch"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        get_backend("triton", "cpu")


def test_unknown_backend_is_named() -> None:
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        get_backend("flash", "cpu")
