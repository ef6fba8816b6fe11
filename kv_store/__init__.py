"""The KV store a deployment's workers share (docs/architecture.md, "KV cache hierarchy"):
the server the launcher starts, and the client each worker's offload tiers use."""

from kv_store.client import StoreClient
from kv_store.server import KVStore, StoreServer

__all__ = ["KVStore", "StoreClient", "StoreServer"]
