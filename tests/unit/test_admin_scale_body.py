"""The admin scale request's body, read without a deployment: every malformed one is a
400 naming the problem (never a 500), and a refusal names the pool it is about."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from router.admin import scale, scale_targets
from router.errors import APIError


@pytest.mark.parametrize("body, words", [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),  # past the parser's recursion limit
    (b"{" + b'"a":' * 1 + b"1" * 5000 + b"}", "not JSON"),  # an integer longer than Python converts
    (b"\xff\xfe", "not JSON"),
    (b"[1, 2]", "JSON object such as"),
])
def test_a_malformed_body_is_a_400(body: bytes, words: str) -> None:
    with pytest.raises(APIError) as err:
        scale_targets(body)
    assert err.value.status == 400 and words in str(err.value)


def refusing(message: str) -> SimpleNamespace:
    def scale_(prefill, decode, reason):
        raise ValueError(message)
    return SimpleNamespace(scale=scale_)


@pytest.mark.parametrize("message, param", [
    ("decode: 4 is beyond autoscale.decode.max (3)", "decode"),
    ("prefill 2 + decode 2 = 4 workers is beyond autoscale.max_workers (3)", None),  # both pools
])
def test_a_refused_target_names_its_pool(message: str, param: str | None) -> None:
    with pytest.raises(APIError) as err:
        asyncio.run(scale(refusing(message), b'{"prefill": 2, "decode": 4}'))
    assert err.value.status == 400 and err.value.param == param and message in str(err.value)
