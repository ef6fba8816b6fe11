"""Shared fixtures: tiny seeded Llama / Mistral / Qwen2 / Qwen3 / OLMo 2 / Phi-3 /
Gemma 2 / Gemma 3 models with a trained tokenizer.

Nothing downloads: the models are random (seeded) and the tokenizer is a byte-level
BPE trained in a fraction of a second on a fixed corpus.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# One OpenMP thread per process, set before torch loads libgomp (it reads this then):
# `make test` runs 4 test processes on 2 cores, beside the workers they start, and a
# torch op with 2 threads spins waiting for one that has no core. The parallel part
# took 8:57 with this and 11:22-12:24 without, using 772 CPU-seconds instead of
# 1,106-1,198 (docs/benchmarks/2026-12-04-codebase.md). A worker's engine.num_threads
# and the one_torch_thread fixture still set their own.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # after OMP_NUM_THREADS is set

# The Triton kernels run on CPU tensors only under the interpreter, and it must be on
# before any @triton.jit function is defined (ENVIRONMENT.md).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Ray reads this once, when first imported: 0 keeps every Ray the tests start (and the
# addresses of the workers on it) on 127.0.0.1 (ENVIRONMENT.md).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

from tests.tiny_models import build_tiny_model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    archs = ("llama", "mistral", "qwen2", "qwen3", "olmo2", "phi3", "gemma2", "gemma3")
    return {arch: build_tiny_model(arch, root / arch) for arch in archs}


@pytest.fixture(scope="session")
def llama_dir(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def lora_models(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Llama ("base") and three PEFT adapters of it (tests/lora_adapters.py), by name."""
    from tests.lora_adapters import build_adapters

    base = tiny_models["llama"]
    adapters = build_adapters(base, tmp_path_factory.mktemp("lora"))
    return {"base": base, **{name: Path(r.lora_path) for name, r in adapters.items()}}


@pytest.fixture(scope="session")
def mqa_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with one KV head (built only by the tests that use it)."""
    return build_tiny_model("llama_mqa", tmp_path_factory.mktemp("tiny_mqa") / "llama_mqa")


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One torch thread for a module's tests (pytestmark = usefixtures): the tiny model's
    steps are all overhead, and two threads on a shared 2-core machine only contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Under pytest-xdist (`make test`: -n with --dist loadfile) each test module is one unit
# of work, so that a module-scoped deployment starts once, on one worker. (Not loadgroup:
# xdist 3.8 marks a group by rewriting item._nodeid, which pytest 9 no longer reads.)
# The modules that take longest are sent first, longest first, so that none of them
# starts late and leaves the other workers idle at the end. Their seconds under `make
# test` (4 workers on 2 cores, 2026-12-08: summed test times of a module, --junitxml);
# the modules not listed took under 15 s and follow, in collection order.
MODULE_SECONDS = {
    "fuzz/test_fuzz_schedules.py": 428, "fidelity/test_moe_fidelity.py": 207, "fidelity/test_tp_fidelity.py": 158,
    "disagg/test_structured_serving.py": 147, "disagg/test_moe_remote_prefill.py": 147,
    "disagg/test_tp_remote_prefill.py": 143, "benchmarks/test_gpu_check_smoke.py": 125,
    "structured/test_engine_constraints.py": 123, "unit/test_tp_failures.py": 103,
    "fidelity/test_triton_fidelity.py": 102, "fidelity/test_lora_fidelity.py": 77,
    "fidelity/test_fp8_kv_fidelity.py": 60, "kv_transfer/test_transports.py": 58,
    "disagg/test_window_remote_prefill.py": 55, "disagg/test_prompt_logprobs_serving.py": 48,
    "benchmarks/test_slo_bench.py": 47, "disagg/test_tp_serving.py": 45, "disagg/test_fp8_remote_prefill.py": 41,
    "fidelity/test_hf_fidelity.py": 39, "unit/test_triton_kernels.py": 39, "fidelity/test_mla_fidelity.py": 35,
    "benchmarks/test_autoscale_bench_smoke.py": 32, "disagg/test_lora_serving.py": 31,
    "unit/test_reference_attention.py": 28, "disagg/test_autoscale_serving.py": 28, "fuzz/test_fuzz_scale.py": 28,
    "disagg/test_elastic_pools.py": 24, "disagg/test_stream_modes.py": 24, "disagg/test_worker_faults.py": 23,
    "kv_transfer/test_fence.py": 21, "unit/test_async_scheduling.py": 21,
    "fidelity/test_sliding_window_fidelity.py": 21, "unit/test_token_controls_llm.py": 20,
    "unit/test_mla_moe_kernels.py": 19, "unit/test_fp8_weights.py": 19, "disagg/test_local_supervision.py": 19,
    "fidelity/test_demo_model_fidelity.py": 18, "unit/test_structured_bench_smoke.py": 18,
    "unit/test_spec_distribution.py": 18, "benchmarks/test_speculative_bench_smoke.py": 16,
    "disagg/test_failover.py": 16, "unit/test_model_loading.py": 15,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def weight(item: pytest.Item) -> int:
        return -MODULE_SECONDS.get(item.nodeid.split("::")[0].removeprefix("tests/"), 0)

    items.sort(key=weight)  # stable: each module keeps its own order


@pytest.fixture(scope="session")
def moe_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny mixtures of experts (tests/tiny_models.py MOE_ARCHS), built only by the tests that use them."""
    from tests.tiny_models import MOE_ARCHS

    root = tmp_path_factory.mktemp("tiny_moe")
    return {arch: build_tiny_model(arch, root / arch) for arch in MOE_ARCHS}
