"""Builds what an EngineCore steps with: the model (and its tensor-parallel group),
the KV pool (sized, allocated), the scheduler, the model runner with its CUDA graphs,
and the speculator. EngineCore's constructor calls build_engine once; nothing here
runs a step.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.kv_quant import cache_dtype, is_fp8
from engine.config import EngineConfig, kv_cache_format
from engine.distributed import shared_cache
from engine.distributed.driver import TPDriver
from engine.distributed.group import SINGLE
from engine.distributed.rank_model import build_rank_model, step_codec
from engine.distributed.sharding import Shard
from engine.gpu_memory import profile_num_kv_blocks
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.shared_tier import SharedTier
from engine.kv_cache.tiers import KVTiers
from engine.lora.slots import LoRASlots
from engine.model.config import ModelConfig, max_model_len, release_window
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import TORCH_DTYPES
from engine.model.rope import factor_set
from engine.runner import KVAllocator, ModelRunner, allocate_kv_cache, kv_cache_shape
from engine.sampling import Sampler
from engine.scheduler import Scheduler
from engine.speculative.draft_model import DraftModelProposer, LoadedDraft, load_draft
from engine.speculative.speculator import Speculator

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """What build_engine made; EngineCore keeps each as an attribute of the same name."""

    model_config: ModelConfig
    shard: Shard  # rank 0's part of the model
    max_model_len: int
    resources: EngineResources  # what close() releases
    model: LlamaForCausalLM
    kv_caches: list[torch.Tensor]  # rank 0's first; every rank's on CPU at TP > 1
    num_blocks: int
    # Per layer, (k_scale, v_scale) of an fp8 cache (engine/attention/kv_quant.py); () otherwise.
    kv_scales: tuple[tuple[float, float], ...]
    kv: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner
    speculator: Speculator | None


def build_engine(config: EngineConfig, kv_allocator: KVAllocator | None = None,
                 keep_cache_files: bool = False, shared_kv: SharedTier | None = None) -> EngineParts:
    """Build an engine's parts (EngineCore's constructor documents the arguments). On
    failure whatever was started (follower ranks, cache files) is released."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    return _Builder(config).build(kv_allocator, keep_cache_files, shared_kv)


class _Builder:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_model_dir(config.model)
        # refuses an unshardable model
        self.shard = Shard.of(self.model_config, 0, config.tensor_parallel_size, config.enable_expert_parallel)
        self.resources = EngineResources()
        self.kv_scales: tuple[tuple[float, float], ...] = ()

    @property
    def tp(self) -> TPDriver | None:
        return self.resources.tp

    def build(self, kv_allocator: KVAllocator | None, keep_cache_files: bool,
              shared_kv: SharedTier | None) -> EngineParts:
        config, model_config = self.config, self.model_config
        model_len = max_model_len(config, model_config)
        try:
            if config.tensor_parallel_size > 1:
                self.resources.tp = TPDriver(config, step_codec(config, model_len))
            model, _, backend, _ = build_rank_model(config, 0, self.tp.group if self.tp else SINGLE)
            # What an fp8 cache's bytes mean: part of the tiers' namespace and the P/D handshake.
            self.kv_scales = model.kv_scales() if is_fp8(self.cache_dtype) else ()
            draft = self._load_draft(model_len)  # before the pool is sized: on CUDA it counts the draft
            # The LoRA slots' buffers too: allocated before the pool is sized, they are in its budget.
            loras = self._loras(model) if config.enable_lora else None
            num_blocks = config.num_kv_blocks or self._pool_blocks(model, backend, model_len, draft)
            kv_caches = self._allocate_caches(num_blocks, kv_allocator, keep_cache_files)
            # A sliding window every layer of every model here keeps to: blocks before it are released.
            window = release_window(model_config, *(() if draft is None else (draft.config,)))
            kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, window,
                                model_config.layer_windows)
            if config.kv_offload_gib > 0:
                kv.attach_tiers(self._tiers(kv_caches, shared_kv, model_len))
            elif shared_kv is not None:
                raise ValueError("a shared KV store needs kv_offload_gib > 0: blocks reach it through the host tier")
            scheduler = Scheduler(kv, config.max_num_batched_tokens, config.max_num_seqs, model_len,
                                  model_config.eos_token_ids, config.enable_chunked_prefill)
            if loras is not None:
                scheduler.loras = self.resources.loras = loras
            runner = ModelRunner(model, kv_caches[0], config.block_size,
                                 Sampler(model_config.eos_token_ids, seed=config.seed),
                                 backend, config.device, self.tp)
            if config.device.startswith("cuda") and not config.enforce_eager:
                if config.enable_lora:
                    logger.info("no CUDA graphs with enable_lora: steps run eagerly")
                elif self.tp is None:
                    self._capture_cuda_graphs(model, runner, backend, model_len)
                else:
                    logger.info("no CUDA graphs at tensor_parallel_size > 1: the ranks run eagerly")
            speculator = self._speculator(kv, num_blocks, model_len, draft)
        except BaseException:
            self.resources.close()
            raise
        cache = kv_caches[0]
        logger.info("engine ready: %s, %d KV blocks of %d tokens (%s, %d B/token a rank%s), max_model_len %d, "
                    "tensor parallel %d", model_config.architecture, num_blocks, config.block_size, cache.dtype,
                    cache[0].nbytes // config.block_size,
                    ", 2x the blocks of a 16-bit cache in the same memory" if is_fp8(cache.dtype) else "",
                    model_len, config.tensor_parallel_size)
        return EngineParts(model_config, self.shard, model_len, self.resources, model, kv_caches, num_blocks,
                           self.kv_scales, kv, scheduler, runner, speculator)

    def _load_draft(self, model_len: int) -> LoadedDraft | None:
        """The draft model (speculative_config.model), checked against this one; None
        without one."""
        spec = self.config.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        return load_draft(self.config, self.model_config, model_len)

    def _speculator(self, kv: KVCacheManager, num_blocks: int, model_len: int,
                    draft: LoadedDraft | None) -> Speculator | None:
        spec = self.config.speculative_config
        if spec is None:
            return None
        if self.config.async_scheduling:
            logger.info("speculative decoding: steps run synchronously (each step's drafts follow "
                        "the tokens the last one accepted); async_scheduling is not used")
        proposer = None
        if draft is not None:
            proposer = DraftModelProposer(draft, self.config, num_blocks, kv)
        return Speculator(spec, model_len, proposer)

    def _allocate_caches(self, num_blocks: int, kv_allocator: KVAllocator | None,
                         keep_files: bool) -> list[torch.Tensor]:
        config, dtype = self.config, self.cache_dtype
        if self.tp is None:
            return [allocate_kv_cache(self.model_config, num_blocks, config.block_size, dtype,
                                      config.device, kv_allocator)]
        if config.device == "cpu":
            shape = kv_cache_shape(self.model_config, num_blocks, config.block_size, self.shard.num_kv_heads)
            self.resources.files, caches = shared_cache.create_rank_caches(shape, dtype, self.shard.size)
            self.tp.attach_caches(self.resources.files, num_blocks)
        else:
            caches = [allocate_kv_cache(self.model_config, num_blocks, config.block_size, dtype,
                                        config.device, num_kv_heads=self.shard.num_kv_heads)]
            self.tp.attach_caches(None, num_blocks)
        self.tp.wait_ready()
        if not keep_files:
            shared_cache.unlink(self.resources.files)
            self.resources.files = []
        return caches

    def _tiers(self, caches: list[torch.Tensor], shared_kv: SharedTier | None, model_len: int) -> KVTiers:
        """The offload tiers, over every rank cache this process reaches."""
        config = self.config
        if config.device.startswith("cuda") and self.tp is not None:
            raise ValueError("kv_offload_gib is not supported with tensor_parallel_size > 1 on CUDA yet: "
                             "each rank's cache lives in its own process")
        # What makes a block's bytes mean what its hash says: the checksums are seeded with it.
        namespace = "|".join(str(part) for part in (
            "pdserve-kv-tier-1", os.path.realpath(config.model), config.dtype, kv_cache_format(config.kv_cache_dtype),
            self.kv_scales, config.quantization or self.model_config.quantization, config.load_format, config.seed,
            config.block_size, [tuple(c.shape[1:]) for c in caches], self.shard.size,
            factor_set(self.model_config.rope_scaling, model_len)))
        # MLA: every rank holds the same latent; the tiers keep rank 0's, loads copy it to the others.
        mirrors = caches[1:] if self.model_config.mla is not None else []
        tiers = KVTiers(caches[:len(caches) - len(mirrors)], int(config.kv_offload_gib * 2**30),
                        config.kv_offload_dir, int(config.kv_offload_disk_gib * 2**30), namespace, mirrors)
        self.resources.tiers = tiers
        if shared_kv is not None:
            tiers.attach_shared(shared_kv)
        return tiers

    @property
    def cache_dtype(self) -> torch.dtype:
        return cache_dtype(self.config.kv_cache_dtype, TORCH_DTYPES[self.config.dtype])

    def _pool_blocks(self, model: LlamaForCausalLM, backend: AttentionBackend, model_len: int,
                     draft: LoadedDraft | None) -> int:
        """On CUDA, the draft model's weights, activations and KV per block are counted;
        on CPU kv_cache_memory_gib is the target's KV alone (a draft's cache is extra)."""
        config = self.config
        if config.device.startswith("cuda") and self.tp is not None:
            # The profiling forward would need the followers' collectives.
            raise ValueError("set num_kv_blocks with tensor_parallel_size > 1 on CUDA: the KV pool "
                             "is not sized by profiling there yet")
        if config.device.startswith("cuda"):
            spec = config.speculative_config
            # A speculating request samples a row per draft and one after them.
            rows = config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec is not None else 0))
            return profile_num_kv_blocks(
                model, self.model_config, backend, config.device, self.cache_dtype, config.block_size,
                config.max_num_batched_tokens, model_len, rows, config.gpu_memory_utilization,
                () if draft is None else [(draft.model, draft.config, draft.backend)])
        # A rank holds only its own KV heads.
        block_bytes = (self.model_config.kv_bytes_per_token(self.cache_dtype.itemsize) * config.block_size
                       * self.shard.num_kv_heads // self.model_config.num_kv_heads)
        num_blocks = int(config.kv_cache_memory_gib * 2**30 // block_bytes)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory_gib={config.kv_cache_memory_gib} is too small for "
                             f"one KV block ({block_bytes} bytes)")
        return num_blocks

    def _loras(self, model: LlamaForCausalLM) -> LoRASlots:
        """The model's projections wrapped to add LoRA deltas, and their slots."""
        from engine.lora.layers import wrap_projections

        config, cfg = self.config, self.model_config
        if cfg.mla is not None or cfg.moe is not None:
            raise ValueError("enable_lora: LoRA adapters on mixture-of-experts and latent-attention models "
                             "are not supported")
        wrapped = wrap_projections(model, cfg, config.max_loras, config.max_lora_rank, TORCH_DTYPES[config.dtype],
                                   config.device, self.shard)
        slots = LoRASlots(wrapped, cfg, config.max_loras, config.max_lora_rank, config.max_cpu_loras or config.max_loras)
        if self.tp is not None:
            tp = self.tp
            slots.on_load = lambda slot, adapter: tp.load_lora(slot, adapter.weights)
        return slots

    def _capture_cuda_graphs(self, model: LlamaForCausalLM, runner: ModelRunner, backend: AttentionBackend,
                             model_len: int) -> None:
        if backend.name != "triton":
            logger.info("no CUDA graphs: the %r attention backend synchronises with the host", backend.name)
            return
        if self.model_config.mla is not None:
            logger.info("no CUDA graphs: MLA's latent store and prompt path synchronise with the host")
            return
        from engine.cuda_graphs import CudaGraphRunner

        rows, spec = None, self.config.speculative_config
        if spec is not None:  # verify steps replay them with a row per token: the last one and the drafts
            rows = min(self.config.max_num_seqs * (spec.num_speculative_tokens + 1), self.config.max_num_batched_tokens)
        graphs = CudaGraphRunner(model, backend, self.config.max_num_seqs, model_len,
                                 self.config.block_size, torch.device(self.config.device), rows)
        graphs.capture()
        runner.graphs = graphs


class EngineResources:
    """What EngineCore.close() releases: follower ranks, cache files, grammar compile
    threads. Apart from the engine so its finalizer does not keep the engine alive."""

    def __init__(self) -> None:
        self.tp: TPDriver | None = None
        self.files: list[str] = []
        self.grammars: Any = None  # engine.structured.compiler.GrammarCompiler, from the first grammar
        self.tiers: KVTiers | None = None
        self.loras: LoRASlots | None = None  # enable_lora: the adapters' slots (engine/lora/slots.py)

    def close(self) -> None:
        if self.tiers is not None:
            self.tiers.close()
            self.tiers = None
        if self.grammars is not None:
            self.grammars.close()
        if self.tp is not None:
            self.tp.close()
        shared_cache.unlink(self.files)
        self.files = []
