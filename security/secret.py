"""The deployment secret: 32 random bytes, and the keys derived from it.

Each use gets its own key, derived as HMAC-SHA256(secret, label), so that no two uses
share one: the CURVE server and client key pairs (every process of the deployment
holds both, since each is a server to some peers and a client of others) and the HMAC
key that tags messages sent outside ZMQ.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import zmq
from zmq.utils import z85

SECRET_BYTES = 32
TAG_BYTES = 32  # HMAC-SHA256


class DeploymentSecret:
    """A deployment's secret. Its repr and str never show it; `hex` is its one
    spelling, for the launcher to hand to the processes it starts."""

    __slots__ = ("_raw", "server_public", "server_secret", "client_public", "client_secret", "_tag_key")

    def __init__(self, raw: bytes) -> None:
        if not isinstance(raw, bytes) or len(raw) != SECRET_BYTES:
            raise ValueError(f"a deployment secret is {SECRET_BYTES} bytes")
        self._raw = raw
        # CURVE secret keys are any 32 bytes (curve25519 clamps them); z85 is libzmq's text form.
        self.server_secret = z85.encode(self._derive(b"pdserve curve server"))
        self.server_public = zmq.curve_public(self.server_secret)
        self.client_secret = z85.encode(self._derive(b"pdserve curve client"))
        self.client_public = zmq.curve_public(self.client_secret)
        self._tag_key = self._derive(b"pdserve message tag")

    @classmethod
    def new(cls) -> DeploymentSecret:
        return cls(secrets.token_bytes(SECRET_BYTES))

    @classmethod
    def from_hex(cls, text: str) -> DeploymentSecret:
        try:
            raw = bytes.fromhex(text)
        except (TypeError, ValueError):
            raise ValueError("a deployment secret is 64 hex digits") from None
        return cls(raw)

    @property
    def hex(self) -> str:
        return self._raw.hex()

    def _derive(self, label: bytes) -> bytes:
        return hmac.new(self._raw, label, hashlib.sha256).digest()

    def tag(self, data: bytes) -> bytes:
        """The HMAC of `data`: proves its sender holds the secret."""
        return hmac.new(self._tag_key, data, hashlib.sha256).digest()

    def verify(self, data: bytes, tag: bytes) -> bool:
        return isinstance(tag, bytes) and hmac.compare_digest(self.tag(data), tag)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeploymentSecret) and hmac.compare_digest(self._raw, other._raw)

    def __hash__(self) -> int:
        return hash(self.client_public)

    def __repr__(self) -> str:
        return "DeploymentSecret(<hidden>)"

    __str__ = __repr__

    def __reduce__(self) -> tuple:  # Ray's actor arguments and multiprocessing's spawn pickle it
        return (DeploymentSecret, (self._raw,))
