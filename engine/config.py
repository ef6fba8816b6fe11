"""Engine configuration: one validated dataclass, built from keyword options."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.config_check import check_instance_types
from engine.speculative.config import SpeculativeConfig

DTYPES = ("float32", "bfloat16", "float16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # an element's, of each of DTYPES
# The KV cache's element type (vLLM's names): "auto" is the model's dtype; the fp8 ones
# store a byte per element (engine/attention/kv_quant.py), "fp8" meaning e4m3.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
FP8_ALIASES = {"fp8": "fp8_e4m3"}  # "fp8" is e4m3, as in vLLM


def kv_cache_format(kv_cache_dtype: str) -> str:
    """The cache's element format for a kv_cache_dtype setting: two settings that name
    the same bytes ("fp8" and "fp8_e4m3") give the same format."""
    return FP8_ALIASES.get(kv_cache_dtype, kv_cache_dtype)
QUANTIZATIONS = ("fp8",)  # engine/model/fp8_linear.py
ATTENTION_BACKENDS = ("auto", "torch", "reference", "triton")  # engine/attention/backend.py
LOAD_FORMATS = ("safetensors", "dummy")  # engine/model/dummy_weights.py


@dataclass
class EngineConfig:
    """Settings of one engine instance (offline LLM, or one worker's engine).

    num_kv_blocks None sizes the KV pool: on CPU from kv_cache_memory_gib; on CUDA from
    gpu_memory_utilization after a profiling forward pass (engine/gpu_memory.py).
    enforce_eager turns off CUDA graphs (engine/cuda_graphs.py); outputs are identical.
    async_scheduling schedules and launches each step before the previous one's tokens
    reach the host, so the host's work overlaps the device's (engine_core.py); greedy
    outputs are identical.
    max_model_len None takes the model's max_position_embeddings.
    load_format "dummy" generates the weights on the device instead of reading them
    (the directory needs only config.json, and a tokenizer to serve): the same seed gives
    the same weights in every process and at every tensor-parallel size
    (engine/model/dummy_weights.py).
    tensor_parallel_size > 1 shards the model over that many processes, one per rank
    (on CUDA one device each, from `device` on); num_threads and kv_cache_memory_gib
    are then per rank.
    speculative_config (engine/speculative): draft tokens, from n-grams of the
    sequence or a draft model, verified by the model k + 1 at a time; a mapping with
    vLLM's keys. Steps then run synchronously (async_scheduling is not used).
    Every field is type-checked against its annotation (engine/config_check.py).
    """

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    num_kv_blocks: int | None = None
    kv_cache_memory_gib: float = 1.0
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    async_scheduling: bool = False
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    attention_backend: str = "auto"
    seed: int = 0
    load_format: str = "safetensors"
    num_threads: int | None = None  # torch intra-op threads on CPU; None = torch default
    prepack_cpu_weights: bool = True  # packed linears on CPU fp32: C panel kernel, else oneDNN (model/cpu_linear.py)
    tensor_parallel_size: int = 1  # processes (ranks) the model is sharded over (engine/distributed)
    # A mixture of experts' experts divided among the ranks, each whole on one, instead
    # of every expert sliced over all of them (engine/model/moe.py).
    enable_expert_parallel: bool = False
    distributed_timeout_s: float = 60.0  # a tensor-parallel collective longer than this fails the engine
    # A structured-output grammar not compiled within this long fails its request (400):
    # compile time grows fast with a schema's size, and a huge one would hold it forever.
    grammar_compile_timeout_s: float = 10.0
    speculative_config: SpeculativeConfig | None = None
    # "auto": the KV cache holds the model's dtype; fp8 kinds hold a byte per element,
    # with the checkpoint's per-layer k_scale/v_scale (else 1.0): twice the blocks of a
    # 16-bit cache in the same memory (engine/attention/kv_quant.py).
    kv_cache_dtype: str = "auto"
    # "fp8": the decoder's linear weights in float8 with a scale per output channel,
    # quantized at load (an FP8 checkpoint is used as it is, with or without this);
    # None: the checkpoint's own (engine/model/fp8_linear.py).
    quantization: str | None = None
    # KV offload tiers (engine/kv_cache/tiers.py): blocks the pool evicts are kept in a
    # host tier of this many GiB (0 = off), and, with kv_offload_dir, written through to
    # a disk tier of kv_offload_disk_gib there; prefix hits load back from them.
    kv_offload_gib: float = 0.0
    kv_offload_dir: str | None = None
    kv_offload_disk_gib: float = 4.0
    # LoRA adapters (engine/lora): requests name one (LoRARequest); up to max_loras of
    # them, of rank up to max_lora_rank, run in one step; max_cpu_loras stay read in
    # host memory (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.speculative_config is not None:  # a mapping from YAML or keyword options
            self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        check_instance_types(self)  # FieldTypeError, naming the field: "512" is no token count

        def require(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        require(isinstance(self.model, str) and self.model != "", "model must be a model directory path")
        require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        require(self.device == "cpu" or self.device.startswith("cuda"),
                f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        require(self.block_size in (8, 16, 32, 64, 128),
                f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        require(self.max_num_batched_tokens >= 1,
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        require(self.num_kv_blocks is None or self.num_kv_blocks >= 1,
                f"num_kv_blocks must be None or >= 1, got {self.num_kv_blocks}")
        require(self.kv_cache_memory_gib > 0,
                f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")
        require(0 < self.gpu_memory_utilization <= 1,
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        require(self.max_model_len is None or self.max_model_len >= 2,
                f"max_model_len must be None or >= 2, got {self.max_model_len}")
        require(self.kv_cache_dtype in KV_CACHE_DTYPES,
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        require(self.quantization is None or self.quantization in QUANTIZATIONS,
                f"quantization must be null or one of {QUANTIZATIONS}, got {self.quantization!r}")
        require(self.attention_backend in ATTENTION_BACKENDS,
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        require(self.load_format in LOAD_FORMATS,
                f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        require(self.num_threads is None or self.num_threads >= 1,
                f"num_threads must be None or >= 1, got {self.num_threads}")
        require(self.tensor_parallel_size >= 1,
                f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        require(self.distributed_timeout_s > 0,
                f"distributed_timeout_s must be > 0, got {self.distributed_timeout_s}")
        require(self.kv_offload_gib >= 0, f"kv_offload_gib must be >= 0 (0 = off), got {self.kv_offload_gib}")
        require(self.kv_offload_disk_gib > 0, f"kv_offload_disk_gib must be > 0, got {self.kv_offload_disk_gib}")
        require(self.kv_offload_dir is None or self.kv_offload_gib > 0,
                "kv_offload_dir needs kv_offload_gib > 0: the disk tier is written through from the host tier")
        require(self.kv_offload_dir != "", "kv_offload_dir must be a directory path or None")
        require(self.kv_offload_gib == 0 or self.enable_prefix_caching,
                "kv_offload_gib needs enable_prefix_caching: the offload tiers keep blocks by prefix hash")
        require(self.max_loras >= 1, f"max_loras must be >= 1, got {self.max_loras}")
        require(self.max_lora_rank >= 1, f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        require(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
                f"max_cpu_loras must be None or >= max_loras ({self.max_loras}), got {self.max_cpu_loras}")
        require(not self.enable_lora or self.speculative_config is None,
                "enable_lora is not supported with speculative_config yet")
        require(self.grammar_compile_timeout_s > 0,
                f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s}")

    @classmethod
    def from_options(cls, model: str, **options: Any) -> EngineConfig:
        """Build from keyword options, naming any unknown key instead of a TypeError."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known options: {sorted(known - {'model'})}")
        return cls(model=model, **options)
