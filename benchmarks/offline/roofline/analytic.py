"""The analytic floor of one engine step, from the model's shape alone: bytes moved and
FLOPs done per kernel class, and the time each class needs at a device's roofs.

A step runs `batch` sequences, each computing `new_tokens` tokens (1 for decode, a
chunk for prefill) on top of `context` tokens already in its KV cache. Per class:

  linears      the per-layer GEMMs (fused qkv, o, fused gate_up, down): each weight
               read once per step, each input read and output written once
  attention    every cached key and value read once per sequence per layer (the new
               tokens' too: the cache write comes first), q read, output written;
               4 FLOPs per head dimension per (query, visible key) pair, causal
  kv_write     the new tokens' k and v read and written into the cache
  lm_head      one logits row per sequence: weights, its hidden row, float32 logits
               written and read back by the sampler
  elementwise  the embedding gather, add+RMSNorm twice per layer and once at the end
               (on the logits rows), rotary on q and k, SiLU-and-mul, counted fused
               as the engine runs them on the GPU; FLOPs per element: add+RMSNorm 5,
               rotary 3, SiLU-and-mul 5 (they never set a class's floor)

A class's floor is max(bytes / bandwidth, FLOPs / peak): it cannot beat either roof,
and its kernels cannot overlap one another's. The step's floor is the sum over classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.offline.roofline.roofs import Roof
    from engine.model.config import ModelConfig

LOGITS_BYTES = 4  # the engine's logits are float32 whatever the model's dtype
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"model shape: {name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_model_config(cls, mc: ModelConfig) -> ModelShape:
        return cls(mc.hidden_size, mc.intermediate_size, mc.num_layers, mc.num_heads, mc.num_kv_heads,
                   mc.head_dim, mc.vocab_size, mc.tie_word_embeddings)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelShape:
        """From a Hugging Face model directory's config.json, read as the engine reads it."""
        from engine.model.config import ModelConfig

        return cls.from_model_config(ModelConfig.from_model_dir(model_dir))

    @property
    def linear_params(self) -> int:
        """Weights of one step's GEMMs, all layers (qkv, o, gate_up, down)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.layers * (h * (q + 2 * kv) + q * h + 3 * h * self.intermediate)

    @property
    def stored_params(self) -> int:
        """Every parameter the model holds (the embedding once if tied)."""
        norms = self.hidden * (2 * self.layers + 1)
        tables = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.linear_params + norms + tables


@dataclass(frozen=True)
class Step:
    """batch sequences x new_tokens each, after context cached tokens each."""

    batch: int
    new_tokens: int
    context: int

    def __post_init__(self) -> None:
        if self.batch < 1 or self.new_tokens < 1 or self.context < 0:
            raise ValueError(f"a step needs batch >= 1, new_tokens >= 1 and context >= 0, got {self}")

    @classmethod
    def decode(cls, batch: int, context: int) -> Step:
        return cls(batch, 1, context)

    @classmethod
    def prefill(cls, chunk: int, context: int = 0, batch: int = 1) -> Step:
        return cls(batch, chunk, context)


@dataclass(frozen=True)
class ClassCost:
    name: str
    bytes: float
    flops: float

    def memory_seconds(self, roof: Roof) -> float:
        return self.bytes / roof.bytes_per_s

    def compute_seconds(self, roof: Roof) -> float:
        return self.flops / roof.flops_per_s

    def floor(self, roof: Roof) -> float:
        return max(self.memory_seconds(roof), self.compute_seconds(roof))

    def bound(self, roof: Roof) -> str:
        return "memory" if self.memory_seconds(roof) >= self.compute_seconds(roof) else "compute"


@dataclass(frozen=True)
class StepCost:
    step: Step
    classes: tuple[ClassCost, ...]

    @property
    def bytes(self) -> float:
        return sum(c.bytes for c in self.classes)

    @property
    def flops(self) -> float:
        return sum(c.flops for c in self.classes)

    @property
    def intensity(self) -> float:
        """FLOPs per byte of the whole step."""
        return self.flops / self.bytes

    def floor(self, roof: Roof) -> float:
        """Sum over kernel classes of each class's floor."""
        return sum(c.floor(roof) for c in self.classes)

    def whole_step_floor(self, roof: Roof) -> float:
        """max(all bytes / bandwidth, all FLOPs / peak): for reference, never above floor()."""
        return max(self.bytes / roof.bytes_per_s, self.flops / roof.flops_per_s)

    def bound(self, roof: Roof) -> str:
        """The bound of the classes that hold most of the floor."""
        memory = sum(c.floor(roof) for c in self.classes if c.bound(roof) == "memory")
        return "memory" if memory >= self.floor(roof) - memory else "compute"


def step_cost(m: ModelShape, step: Step, dtype_bytes: int) -> StepCost:
    e, n, b = dtype_bytes, step.new_tokens, step.batch
    h, i, layers = m.hidden, m.intermediate, m.layers
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    t = b * n  # tokens through the layers
    s = b  # logits rows: one per sequence
    # qkv: in h, out q+2kv; o: in q, out h; gate_up: in h, out 2i; down: in i, out h.
    linear_acts = layers * t * (4 * h + 2 * q + 2 * kv + 3 * i)
    linears = ClassCost("linears", e * (m.linear_params + linear_acts), 2.0 * t * m.linear_params)
    pairs = b * (n * step.context + n * (n + 1) // 2)  # (query, visible key) pairs, causal
    attention = ClassCost("attention", e * layers * (b * (step.context + n) * 2 * kv + 2 * t * q),
                          4.0 * layers * m.heads * m.head_dim * pairs)
    kv_write = ClassCost("kv_write", e * layers * 2 * t * 2 * kv, 0.0)
    lm_head = ClassCost("lm_head", e * (m.vocab * h + s * h) + 2 * LOGITS_BYTES * s * m.vocab,
                        2.0 * s * h * m.vocab)
    per_layer_bytes = 2 * (4 * t * h + h) + 2 * t * (q + kv) + 3 * t * i
    per_layer_flops = 2 * 5 * t * h + 3 * t * (q + kv) + 5 * t * i
    elementwise = ClassCost("elementwise",
                            e * (2 * t * h + layers * per_layer_bytes + 3 * s * h + h),
                            float(layers * per_layer_flops + 5 * s * h))
    return StepCost(step, (linears, attention, kv_write, lm_head, elementwise))


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    return DTYPE_BYTES[dtype]
