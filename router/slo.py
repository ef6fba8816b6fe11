"""A request's latency targets (SLOs): time to first token and time per output token.

Where a target comes from, the first that sets it winning, target by target:
1. the body's extra fields `slo_ttft_ms` / `slo_tpot_ms` (as vLLM takes extras);
2. the headers `x-slo-ttft-ms` / `x-slo-tpot-ms` (a gateway in front may set them);
3. the API key's defaults (`router.slo.key_defaults`, by the key's position in
   router.api_keys);
4. the deployment's (`router.slo.ttft_ms` / `tpot_ms`).
A request with neither target has no SLO: it is admitted as before, and its latency is
still predicted (the predictor's error is measured on every request).

What the router does with them is router/admission.py's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from router.errors import APIError

POLICIES = ("reject", "best_effort", "off")
FIELDS = ("slo_ttft_ms", "slo_tpot_ms")
HEADERS = {"slo_ttft_ms": "x-slo-ttft-ms", "slo_tpot_ms": "x-slo-tpot-ms"}
MAX_MS = 86_400_000.0  # a day: a target beyond it is a mistake, not a target
MIN_MS = 0.001  # a microsecond: below, a target is no target a server can be measured against
# A header's number: plain decimal, as JSON writes one (no Python extras: 1_000, nan, inf).
HEADER_NUMBER = re.compile(r"[0-9]+(\.[0-9]*)?([eE][+-]?[0-9]+)?|\.[0-9]+([eE][+-]?[0-9]+)?")


@dataclass(frozen=True)
class Targets:
    """Milliseconds each; None: no target for that latency."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def any(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def met(self, ttft_s: float, tpot_s: float | None) -> bool:
        """Whether a finished request met both targets (tpot_s None: fewer than two
        output tokens, no TPOT to miss)."""
        if self.ttft_ms is not None and ttft_s * 1000 > self.ttft_ms:
            return False
        return self.tpot_ms is None or tpot_s is None or tpot_s * 1000 <= self.tpot_ms


NO_TARGETS = Targets()


class SLOSettings(Protocol):
    """`router.slo` (cluster/slo_config.py validates and documents each field)."""

    @property
    def policy(self) -> str: ...  # reject | best_effort | off

    @property
    def ttft_ms(self) -> float | None: ...

    @property
    def tpot_ms(self) -> float | None: ...

    # Per API key (its position in router.api_keys): its default targets; None: the deployment's.
    @property
    def key_defaults(self) -> tuple[Targets | None, ...] | None: ...


def _checked(value: Any, name: str, where: str) -> float:
    # Compared, never converted first: an int of hundreds of digits (JSON allows it) would
    # overflow float(); nan and inf fail the comparison.
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and MIN_MS <= value <= MAX_MS
    if not ok:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
        raise APIError(400, f"{where} must be a number of milliseconds in [{MIN_MS:g}, {MAX_MS:.0f}], got {shown}",
                       name)
    return float(value)


def body_targets(body: Mapping[str, Any]) -> Targets:
    """The targets a request body sets (400 naming the field for a bad one)."""
    values = {f: None if body.get(f) is None else _checked(body[f], f, f) for f in FIELDS}
    return Targets(values["slo_ttft_ms"], values["slo_tpot_ms"])


def header_targets(headers: Headers) -> Targets:
    """The targets the headers set (400 naming the header for a bad one, or one given
    twice: which of two values was meant cannot be told)."""
    values: dict[str, float | None] = {}
    for field, header in HEADERS.items():
        given = headers.getlist(header)
        if len(given) > 1:
            raise APIError(400, f"header {header} is given {len(given)} times; send it once", field)
        if not given:
            values[field] = None
            continue
        raw = given[0].strip()
        number: Any = float(raw) if HEADER_NUMBER.fullmatch(raw) else raw
        values[field] = _checked(number, field, f"header {header}")
    return Targets(values["slo_ttft_ms"], values["slo_tpot_ms"])


class Headers(Protocol):
    """A request's headers as Starlette gives them (case-insensitive, repeatable)."""

    def getlist(self, key: str) -> list[str]: ...


def resolve(body: Targets, headers: Targets, client: int | None, settings: SLOSettings | None) -> Targets:
    """The request's targets: each from the first source that sets it (module doc)."""
    key: Targets | None = None
    defaults: Sequence[Targets | None] = (settings.key_defaults if settings is not None else None) or ()
    if client is not None and client < len(defaults):
        key = defaults[client]
    chain = [body, headers, key or Targets(), Targets(settings.ttft_ms, settings.tpot_ms) if settings else Targets()]
    ttft = next((t.ttft_ms for t in chain if t.ttft_ms is not None), None)
    tpot = next((t.tpot_ms for t in chain if t.tpot_ms is not None), None)
    return Targets(ttft, tpot)
