"""What every section of the cluster config is checked with: each mistake a ConfigError
naming its path in the file (cluster/config.py)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from engine.config_check import FieldTypeError, check_field_types


class ConfigError(ValueError):
    """A cluster config mistake, named with its path in the file."""


def check(ok: bool, path: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{path}: {message}")


def checked_mapping(cls: type, data: Any, path: str, choices: dict[str, Any] | None = None) -> dict[str, Any]:
    """The mapping `data` checked against cls's fields: a mapping, no unknown keys, each
    value of its field's type (nested sections are checked by their own from_dict). A
    field with `choices` of the wrong type is told its choices, not only its type."""
    check(isinstance(data, dict), path or "config", f"must be a mapping, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known, key=str)
    prefix = f"{path}." if path else ""
    check(not unknown, f"{prefix}{unknown[0] if unknown else ''}",
          f"unknown key; known keys here: {sorted(known)}")
    try:
        check_field_types(cls, data)
    except FieldTypeError as exc:
        name = exc.path.split(".")[0]
        if choices and name in choices:
            raise ConfigError(f"{prefix}{name}: must be one of {choices[name]}, got {data[name]!r}") from None
        raise ConfigError(f"{prefix}{exc}") from None
    return data


def integer(value: Any, path: str, minimum: int, maximum: int | None = None) -> int:
    check(isinstance(value, int) and not isinstance(value, bool), path,
          f"must be an integer, got {value!r}")
    check(value >= minimum, path, f"must be >= {minimum}, got {value}")
    check(maximum is None or value <= maximum, path, f"must be <= {maximum}, got {value}")
    return value


def number(value: Any, path: str, minimum: float, *, strict: bool = False) -> float:
    check(isinstance(value, (int, float)) and not isinstance(value, bool), path, f"must be a number, got {value!r}")
    # An integer too large for a float (YAML reads 1e400 as a string, but 10**400 as an int).
    check(not isinstance(value, int) or abs(value) < 2**1023, path, f"must be finite, got {value}")
    check(math.isfinite(value), path, f"must be finite, got {value}")
    check(value > minimum if strict else value >= minimum, path,
          f"must be {'>' if strict else '>='} {minimum}, got {value}")
    return float(value)
