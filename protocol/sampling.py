"""SamplingParams' one wire form: a Struct with exactly SamplingParams' fields, types
and defaults (made from the dataclass, so the two cannot drift apart). Decoding checks
each value's type against the field's (a bool is not an int, a string not a float) and
refuses an unknown field; a message that fails names the field, and the worker answers
that request alone (protocol/wire.py reads its request_id back). The ranges are checked
where the worker rebuilds the SamplingParams (its __post_init__ names the field), so a
bad value is that request's 400, as a bad HTTP body is."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import msgspec

from engine.sampling_params import SamplingParams
from engine.structured.params import StructuredOutputsParams

_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]
# A field whose wire type is not its Python type: a structured-outputs request crosses as
# the map of its one set key (StructuredOutputsParams.to_dict / its constructor).
_WIRE_TYPES: dict[Any, Any] = {StructuredOutputsParams | None: dict[str, Any] | None}


def _field(f: dataclasses.Field, hint: Any) -> tuple[str, Any, Any]:
    wire_type = _WIRE_TYPES.get(hint, hint)
    if f.default is not dataclasses.MISSING:
        return f.name, wire_type, f.default
    if f.default_factory is dataclasses.MISSING:
        raise TypeError(f"SamplingParams.{f.name} needs a default to have a wire form")
    return f.name, wire_type, msgspec.field(default_factory=f.default_factory)


_hints = typing.get_type_hints(SamplingParams)
WireSamplingParams = msgspec.defstruct(
    "WireSamplingParams", [_field(f, _hints[f.name]) for f in dataclasses.fields(SamplingParams)], kw_only=True,
    frozen=True, forbid_unknown_fields=True)


def to_wire(params: SamplingParams) -> Any:
    values = {name: getattr(params, name) for name in _FIELDS}
    if params.structured_outputs is not None:  # a dataclass; its one set key as a map
        values["structured_outputs"] = params.structured_outputs.to_dict()
    return WireSamplingParams(**values)


def from_wire(wire: Any) -> SamplingParams:
    """Raises SamplingParamsError (a ValueError) naming a bad field."""
    return SamplingParams(**{name: getattr(wire, name) for name in _FIELDS})
