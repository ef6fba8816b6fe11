"""SamplingParams' one wire form: a Struct with exactly SamplingParams' fields (made
from the dataclass, so the two cannot drift apart) and their defaults; an unknown field
is refused when the message is decoded. The values are checked where the worker
rebuilds the SamplingParams (its __post_init__ checks types and ranges and names the
field), so a bad value is that request's 400, as a bad HTTP body is."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from engine.sampling_params import SamplingParams

_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]


def _field(f: dataclasses.Field) -> tuple[str, Any, Any]:
    if f.default is not dataclasses.MISSING:
        return f.name, Any, f.default
    if f.default_factory is dataclasses.MISSING:
        raise TypeError(f"SamplingParams.{f.name} needs a default to have a wire form")
    return f.name, Any, msgspec.field(default_factory=f.default_factory)


WireSamplingParams = msgspec.defstruct(
    "WireSamplingParams", [_field(f) for f in dataclasses.fields(SamplingParams)], kw_only=True, frozen=True,
    forbid_unknown_fields=True)


def to_wire(params: SamplingParams) -> Any:
    values = {name: getattr(params, name) for name in _FIELDS}
    if params.structured_outputs is not None:  # a dataclass; its one set key as a map
        values["structured_outputs"] = params.structured_outputs.to_dict()
    return WireSamplingParams(**values)


def from_wire(wire: Any) -> SamplingParams:
    """Raises SamplingParamsError (a ValueError) naming a bad field."""
    return SamplingParams(**{name: getattr(wire, name) for name in _FIELDS})
