"""Which part of the model a tensor-parallel rank holds (Megatron-style).

- Attention: query heads split evenly; KV heads split evenly, or, when there are
  fewer KV heads than ranks, each rank holds the one KV head its query heads read
  (replicated on size // num_kv_heads ranks).
- MLP: the intermediate dimension split evenly (gate_up column-parallel, down row-parallel);
  in a mixture of experts, every expert's and the shared expert's alike, or, expert
  parallel, each rank holding E / N whole experts (the shared expert still split).
- Embedding and lm_head: the vocabulary split into equal ranges, the last one padded
  with zero rows when the vocabulary does not divide.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model.config import ModelConfig


def check_shardable(cfg: ModelConfig, size: int, expert_parallel: bool = False) -> None:
    """Raise ValueError naming the dimension that does not split over `size` ranks."""
    if expert_parallel and cfg.moe is None:
        raise ValueError(f"enable_expert_parallel: {cfg.architecture} has no experts to divide among the ranks")
    if size == 1:
        return
    problems = []
    if cfg.num_heads % size:
        problems.append(f"{cfg.num_heads} attention heads do not divide by tensor_parallel_size {size}")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        problems.append(f"{cfg.num_kv_heads} KV heads neither divide by nor divide "
                        f"tensor_parallel_size {size}")
    if cfg.intermediate_size % size:
        problems.append(f"intermediate_size {cfg.intermediate_size} does not divide by "
                        f"tensor_parallel_size {size}")
    if cfg.moe is not None:
        widths = [("shared_expert_intermediate_size", cfg.moe.shared_intermediate_size)]
        if not expert_parallel:
            widths.append(("moe_intermediate_size", cfg.moe.intermediate_size))
        elif cfg.moe.num_experts % size:
            problems.append(f"enable_expert_parallel: {cfg.moe.num_experts} experts do not divide by "
                            f"tensor_parallel_size {size}")
        for name, width in widths:
            if width % size:
                problems.append(f"{name} {width} does not divide by tensor_parallel_size {size}")
    if problems:
        raise ValueError(f"{cfg.architecture} cannot be sharded: " + "; ".join(problems))


def kv_head_range(num_kv_heads: int, size: int, rank: int) -> tuple[int, int]:
    """The global KV heads [start, end) rank `rank` of `size` holds."""
    if num_kv_heads >= size:
        per = num_kv_heads // size
        return rank * per, (rank + 1) * per
    head = rank // (size // num_kv_heads)  # replicated: the head of this rank's query heads
    return head, head + 1


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`: the ranges of every sharded dimension it holds."""

    rank: int
    size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]  # may end past vocab_size: padding rows, zero
    vocab_size: int
    # A mixture of experts: the experts the rank holds (all of them, unless expert
    # parallel), the range of each one's intermediate dimension (all of it when expert
    # parallel), and of the shared expert's ((0, 0) without).
    experts: tuple[int, int] = (0, 0)
    expert_intermediate: tuple[int, int] = (0, 0)
    shared_intermediate: tuple[int, int] = (0, 0)

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int = 0, size: int = 1, expert_parallel: bool = False) -> Shard:
        check_shardable(cfg, size, expert_parallel)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in a group of {size}")
        q = cfg.num_heads // size
        inter = cfg.intermediate_size // size
        vocab = -(-cfg.vocab_size // size)
        experts, expert, shared = (0, 0), (0, 0), (0, 0)
        if cfg.moe is not None:
            e, i, s = cfg.moe.num_experts, cfg.moe.intermediate_size, cfg.moe.shared_intermediate_size // size
            if expert_parallel:
                experts, expert = (rank * (e // size), (rank + 1) * (e // size)), (0, i)
            else:
                experts, expert = (0, e), (rank * (i // size), (rank + 1) * (i // size))
            shared = (rank * s, (rank + 1) * s)
        return cls(rank, size, (rank * q, (rank + 1) * q), kv_head_range(cfg.num_kv_heads, size, rank),
                   (rank * inter, (rank + 1) * inter), (rank * vocab, (rank + 1) * vocab), cfg.vocab_size,
                   experts, expert, shared)

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    @property
    def num_experts(self) -> int:
        return self.experts[1] - self.experts[0]

    @property
    def expert_intermediate_size(self) -> int:
        return self.expert_intermediate[1] - self.expert_intermediate[0]

    @property
    def shared_intermediate_size(self) -> int:
        return self.shared_intermediate[1] - self.shared_intermediate[0]

    @property
    def vocab_rows(self) -> int:
        return self.vocab[1] - self.vocab[0]
