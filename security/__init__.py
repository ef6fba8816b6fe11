"""The worker plane's security: the deployment secret and what it authenticates.

Every deployment has a secret, made at launch (`DeploymentSecret.new()`) and handed to
its processes by the launcher (never written to a file or a log). From it come the
CURVE keys of every ZMQ socket between the router and the workers and between workers
(curve.py: encryption, and a ZAP handler that admits only clients holding the secret,
logging every peer it refuses), and HMAC tags for what travels outside ZMQ (the KV
handshake blob, nixl's notifications).
"""

from security.curve import PlaneGuard, connect_securely, serve_securely
from security.secret import DeploymentSecret

__all__ = ["DeploymentSecret", "PlaneGuard", "connect_securely", "serve_securely"]
