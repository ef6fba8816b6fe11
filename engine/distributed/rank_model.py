"""What every rank of a tensor-parallel group builds alike: its part of the model, and
the layout of a step's broadcast. The driver (engine_core.py) and each follower
(follower.py) call these with their own rank."""

from __future__ import annotations

from engine.attention.backend import AttentionBackend, get_backend
from engine.config import EngineConfig
from engine.distributed.group import SINGLE, Group
from engine.distributed.sharding import Shard
from engine.distributed.step_codec import StepCodec
from engine.model.config import ModelConfig, max_model_len
from engine.model.cpu_linear import prepack_linears, prepack_supported
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import TORCH_DTYPES, load_model


def build_rank_model(config: EngineConfig, rank: int = 0, group: Group = SINGLE
                     ) -> tuple[LlamaForCausalLM, ModelConfig, AttentionBackend, int]:
    """One rank's model (all of it at tensor_parallel_size 1): (model, its config, the
    attention backend, max_model_len). The driver and every follower build theirs so."""
    backend = get_backend(config.attention_backend, config.device)
    model_config = ModelConfig.from_model_dir(config.model)
    model_len = max_model_len(config, model_config)
    shard = Shard.of(model_config, rank, config.tensor_parallel_size, config.enable_expert_parallel)
    model = load_model(config.model, model_config, config.dtype, config.device, backend, model_len,
                       shard, group, config.load_format, config.seed, config.quantization)
    if config.prepack_cpu_weights and prepack_supported(config.device, TORCH_DTYPES[config.dtype]):
        prepack_linears(model)
    return model, model_config, backend, model_len


def step_codec(config: EngineConfig, model_len: int) -> StepCodec:
    """The broadcast layout of a step, the same on every rank."""
    return StepCodec(config.max_num_batched_tokens, config.max_num_seqs, config.block_size, model_len)
