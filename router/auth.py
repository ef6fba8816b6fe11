"""API keys at the router: which configured key, if any, a request's Authorization
header carries, as OpenAI clients send it (`Authorization: Bearer <key>`).

Keys are kept only as SHA-256 digests, and a presented key is compared, in constant
time, with every configured one (no early exit), so neither the time an answer takes
nor a memory dump says which key nearly matched. A key is named by its position in
router.api_keys (per-key limits count by it); the key itself is never logged or
echoed in an error.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from router.errors import APIError

REALM = 'Bearer realm="pdserve"'


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class KeyRing:
    """Who calls what: the HTTP guard (router/http_guard.py) calls identify() once per
    request that needs a key."""

    def __init__(self, keys: Iterable[str], kind: str = "API key") -> None:
        self._digests = [_digest(k) for k in keys]
        self.kind = kind  # what its errors call a key: "API key", or "admin key" for router.admin_keys

    def __len__(self) -> int:
        return len(self._digests)

    def identify(self, authorization: bytes | None) -> int:
        """The index of the configured key the header carries; APIError(401) for a
        missing or malformed header or a key that is not configured."""
        if authorization is None:
            raise unauthorized(f"You didn't provide an {self.kind}. Send it in an Authorization header using "
                               "Bearer auth (Authorization: Bearer YOUR_KEY)", REALM)
        scheme, _, token = authorization.decode("latin-1").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise unauthorized("The Authorization header must be 'Bearer YOUR_KEY'",
                               f'{REALM}, error="invalid_request"')
        presented = _digest(token)
        found = -1
        for i, digest in enumerate(self._digests):  # all of them, whatever matches
            if hmac.compare_digest(presented, digest):
                found = i
        if found < 0:
            raise unauthorized(f"Incorrect {self.kind} provided", f'{REALM}, error="invalid_token"')
        return found

    def fingerprint(self, index: int) -> str:
        """What a log line may name key `index` by: the first 8 hex digits of its SHA-256
        (`printf %s "$KEY" | sha256sum | cut -c1-8`), never the key."""
        return self._digests[index].hex()[:8]


def unauthorized(message: str, challenge: str) -> APIError:
    """OpenAI's answer to a bad key: 401, type invalid_request_error, code invalid_api_key."""
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": challenge})
