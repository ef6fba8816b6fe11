"""Where the router's API keys come from (`router.api_keys`), resolved once, when the
cluster config loads, and whether a bind address is only reachable from this machine.

`router.api_keys` is one of:
- a YAML list of keys: `api_keys: [sk-one, sk-two]`;
- `"env:NAME"`: the environment variable NAME holds the keys, comma-separated;
- `"file:PATH"`: the file at PATH (relative to the working directory, as `model` is)
  holds one key per line; blank lines and lines starting with `#` are ignored.

The one invariant: a key never appears in an error message, a log line or a repr.
Errors say which key (its position) and what is wrong with it, never the key itself.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Any

ENV_PREFIX = "env:"
FILE_PREFIX = "file:"
SPELLINGS = "a list of keys, 'env:NAME' (comma-separated keys) or 'file:PATH' (one key per line)"


def resolve_api_keys(value: Any) -> tuple[str, ...]:
    """The keys `value` names, in order, without duplicates; () for null. ValueError (its
    message without the field's path, and without any key) for a spelling that is not
    one of the three, a missing or empty source, or a key no HTTP header can carry."""
    if value is None:
        return ()
    if isinstance(value, list):
        keys, source = value, "the list"
    elif isinstance(value, str) and value.startswith(ENV_PREFIX):
        name = value[len(ENV_PREFIX):]
        if not name:
            raise ValueError("'env:' must name an environment variable, e.g. 'env:PDSERVE_API_KEYS'")
        if name not in os.environ:
            raise ValueError(f"environment variable {name} is not set (it must hold the keys, comma-separated)")
        keys, source = [k.strip() for k in os.environ[name].split(",") if k.strip()], f"environment variable {name}"
    elif isinstance(value, str) and value.startswith(FILE_PREFIX):
        path = Path(value[len(FILE_PREFIX):])
        try:
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the key file {str(path)!r}: {type(exc).__name__}: "
                             f"{getattr(exc, 'strerror', None) or exc}") from None
        keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        source = f"the key file {str(path)!r}"
    else:
        # A bare string or a mapping may well hold a key: say its type, never its value.
        got = repr(value) if isinstance(value, (bool, int, float)) else f"a {type(value).__name__}"
        raise ValueError(f"must be {SPELLINGS}, or null for none"
                         + (" (a bare string is not taken as a key)" if isinstance(value, str) else "")
                         + f"; got {got}")
    if not keys:
        raise ValueError(f"{source} holds no key (leave the field null for none)")
    for i, key in enumerate(keys):
        if not isinstance(key, str) or not key:
            raise ValueError(f"key {i} of {source} must be a non-empty string, got a {type(key).__name__}")
        if not all("\x21" <= c <= "\x7e" for c in key) or "," in key:
            raise ValueError(f"key {i} of {source} has a space, a comma or a character that is not printable "
                             "ASCII (an Authorization header could not carry it)")
    return tuple(dict.fromkeys(keys))


def is_loopback(host: str) -> bool:
    """Whether binding `host` serves only this machine: a loopback address or
    `localhost`. Any other name may resolve to a reachable address, so it is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
