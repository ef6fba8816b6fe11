"""What EngineCore.step raises when a step fails (engine/errors.py): a model-side
failure voids the step and names its requests (the engine goes on); a failure of the
scheduler's own bookkeeping is an EngineStateError (nothing can be trusted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.errors import EngineStateError, RequestsFailed

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14]]


def run(core: EngineCore) -> dict[str, list[int]]:
    done = {}
    for _ in range(200):
        if not core.has_unfinished():
            return done
        done.update((r.request_id, r.output_token_ids) for r in core.step().finished)
    raise AssertionError("the engine did not finish")


def fail_once(obj, name: str, exc: Exception) -> None:
    real = getattr(obj, name)

    def failing(*args, **kwargs):
        setattr(obj, name, real)
        raise exc
    setattr(obj, name, failing)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("where", ["launch", "result"])
def test_a_model_failure_fails_the_step_s_requests_and_the_engine_goes_on(
        llama_dir: Path, async_scheduling: bool, where: str) -> None:
    expected = [o.token_ids for o in LLM(str(llama_dir), num_kv_blocks=64).generate(PROMPTS, GREEDY, use_tqdm=False)]
    core = EngineCore(EngineConfig(model=str(llama_dir), num_kv_blocks=64, async_scheduling=async_scheduling))
    core.add_request("a", PROMPTS[0], GREEDY)
    core.add_request("b", PROMPTS[1], GREEDY)
    core.step()
    core.step()
    if where == "launch":
        fail_once(core.runner, "launch", RuntimeError("device lost"))
    else:  # the step's tokens are waited for in the next call (async) or this one
        real_launch = core.runner.launch

        def launch(*args, **kwargs):
            core.runner.launch = real_launch
            launched = real_launch(*args, **kwargs)
            fail_once(launched, "result", RuntimeError("device lost"))
            return launched
        core.runner.launch = launch
    with pytest.raises(RequestsFailed, match=r"the model step failed \(RuntimeError: device lost\)") as failure:
        for _ in range(3):
            core.step()
    assert sorted(failure.value.request_ids) == ["a", "b"]
    core.abort(failure.value.request_ids)
    assert core.kv.num_free_blocks == core.kv.pool.num_blocks
    core.add_request("c", PROMPTS[2], GREEDY)
    assert run(core) == {"c": expected[2]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where,exc,message", [
    # The scheduler's own bookkeeping failed part-way.
    ("update", KeyError("a"), "the scheduler failed: KeyError"),
    # A broken invariant found on the model side stays what it is.
    ("launch", EngineStateError("placeholder tokens without a step in flight"), "placeholder tokens"),
])
def test_a_broken_state_is_an_engine_state_error(llama_dir: Path, where: str, exc: Exception, message: str) -> None:
    core = EngineCore(EngineConfig(model=str(llama_dir), num_kv_blocks=64))
    core.add_request("a", PROMPTS[0], GREEDY)
    fail_once(core.scheduler if where == "update" else core.runner, where, exc)
    with pytest.raises(EngineStateError, match=message):
        core.step()
