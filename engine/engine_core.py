"""The engine core: model + KV cache + scheduler + sampler, advanced one step at a time.

No tokenizer and no text here: the core speaks token ids, so the same core serves the
offline LLM, a decode worker and a prefill worker.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from engine.attention.backend import AttentionBackend, get_backend
from engine.config import EngineConfig
from engine.gpu_memory import profile_num_kv_blocks
from engine.kv_cache.manager import KVCacheManager
from engine.model.config import ModelConfig
from engine.model.cpu_linear import prepack_linears, prepack_supported
from engine.model.loader import TORCH_DTYPES, load_model
from engine.request import Request, RequestStatus
from engine.runner import ModelRunner, allocate_kv_cache
from engine.sampling import Sampler, make_generator
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class StepOutput:
    advanced: list[Request] = field(default_factory=list)  # got a new token this step
    finished: list[Request] = field(default_factory=list)  # finished this step (blocks freed)
    num_tokens: int = 0  # tokens computed this step


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        backend = get_backend(config.attention_backend, config.device)
        self.model_config = ModelConfig.from_model_dir(config.model)
        self.max_model_len = model_len = self._max_model_len(config, self.model_config)
        self.model = load_model(config.model, self.model_config, config.dtype, config.device,
                                backend, model_len)
        dtype = TORCH_DTYPES[config.dtype]
        if config.prepack_cpu_weights and prepack_supported(config.device, dtype):
            prepack_linears(self.model)
        num_blocks = config.num_kv_blocks or self._pool_blocks(backend, dtype, model_len)
        self.kv_cache = allocate_kv_cache(self.model_config, num_blocks, config.block_size, dtype,
                                          config.device)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, config.max_num_seqs,
                                   model_len, self.model_config.eos_token_ids,
                                   config.enable_chunked_prefill)
        self.runner = ModelRunner(self.model, self.kv_cache, config.block_size,
                                  Sampler(self.model_config.eos_token_ids, seed=config.seed),
                                  backend, config.device)
        if config.device.startswith("cuda") and not config.enforce_eager:
            self._capture_cuda_graphs(backend, model_len)
        logger.info("engine ready: %s, %d KV blocks of %d tokens, max_model_len %d",
                    self.model_config.architecture, num_blocks, config.block_size, model_len)

    def _pool_blocks(self, backend: AttentionBackend, dtype: torch.dtype, model_len: int) -> int:
        config = self.config
        if config.device.startswith("cuda"):
            return profile_num_kv_blocks(
                self.model, self.model_config, backend, config.device, dtype, config.block_size,
                min(config.max_num_batched_tokens, model_len), config.max_num_seqs,
                config.gpu_memory_utilization)
        block_bytes = self.model_config.kv_bytes_per_token(dtype.itemsize) * config.block_size
        num_blocks = int(config.kv_cache_memory_gib * 2**30 // block_bytes)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory_gib={config.kv_cache_memory_gib} is too small for "
                             f"one KV block ({block_bytes} bytes)")
        return num_blocks

    def _capture_cuda_graphs(self, backend: AttentionBackend, model_len: int) -> None:
        if backend.name != "triton":
            logger.info("no CUDA graphs: the %r attention backend synchronises with the host", backend.name)
            return
        from engine.cuda_graphs import CudaGraphRunner

        graphs = CudaGraphRunner(self.model, backend, self.config.max_num_seqs, model_len,
                                 self.config.block_size, torch.device(self.config.device))
        graphs.capture()
        self.runner.graphs = graphs

    @staticmethod
    def _max_model_len(config: EngineConfig, mc: ModelConfig) -> int:
        limit = mc.max_position_embeddings
        # No sliding-window attention: stay within the window, where it equals full attention.
        if mc.sliding_window:
            limit = min(limit, mc.sliding_window)
        if config.max_model_len is not None:
            if config.max_model_len > limit:
                raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                                 f"supported context {limit}")
            limit = config.max_model_len
        return limit

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0) -> Request:
        """Queue a request; raises ValueError (and changes nothing) if it can never run."""
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:5]}")
        request = Request(request_id, list(prompt_token_ids), params, priority=priority)
        if params.seed is not None:
            request.generator = make_generator(params.seed, self.config.device)
        self.scheduler.add_request(request)
        return request

    def abort(self, request_ids: list[str]) -> list[Request]:
        return self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_stopped(self, request_ids: list[str]) -> list[Request]:
        """Finish requests that hit a stop string (detected outside the core)."""
        return self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> StepOutput:
        out = self.scheduler.schedule()
        if not out.scheduled:
            return StepOutput()
        block_ids = [self.kv.block_ids(s.request.request_id) for s in out.scheduled]
        sampled = self.runner.execute(out.scheduled, block_ids)
        sampling = [s.request for s in out.scheduled if s.samples]
        for request, logprobs in zip(sampling, sampled.logprobs):
            if logprobs is not None:
                request.output_logprobs.append(logprobs)
        tokens = {r.request_id: t for r, t in zip(sampling, sampled.token_ids)}
        advanced, finished = self.scheduler.update(out, tokens)
        return StepOutput(advanced, finished, out.num_tokens)
