"""The rules the router owns (prompt logprobs prefill locally, the context length, the
vocabulary) are only guarded on the decode worker: a request breaking one is a router
bug, refused with status 500, never a second 400 for the user (decode_worker/guards.py).
Bad input the worker itself judges is still a 400."""

from __future__ import annotations

from pathlib import Path

import pytest

from decode_worker.guards import RouterBug, check_router_rules
from engine.sampling_params import SamplingParams
from protocol import Generate
from tests.unit.test_stall_watchdog import GREEDY, Rig


def test_the_guard_names_the_first_rule_broken() -> None:
    ok = SamplingParams(max_tokens=4)
    check_router_rules([1, 2, 3], ok, True, 8, 10)  # fits: nothing raised
    cases = [
        (([1, 2], SamplingParams(max_tokens=4, prompt_logprobs=1), True, 8, 10), "remote prefill was asked"),
        (([1, 2, 3, 4, 5], ok, False, 8, 10), r"prompt \(5 tokens\) \+ max_tokens \(4\) exceeds the context length 8"),
        (([1, 10], ok, False, 8, 10), r"prompt token ids must be integers in \[0, 10\), got \[10\]"),
        (([1], SamplingParams(max_tokens=4, logit_bias={12: 1.0}), False, 8, 10),
         r"logit_bias token ids must be in \[0, 10\), got \[12\]"),
    ]
    for args, message in cases:
        with pytest.raises(RouterBug, match=message):
            check_router_rules(*args)


@pytest.mark.timeout(60)
def test_a_served_request_breaking_a_router_rule_is_an_internal_error(llama_dir: Path) -> None:
    rig = Rig(llama_dir, stall_timeout_s=None)
    try:
        too_long = rig.engine.max_model_len
        sent = {
            "logprobs-remote": (list(range(10, 50)), dict(GREEDY, prompt_logprobs=1), True),
            "too-long": ([5] * too_long, GREEDY, False),
            "vocab": ([5, 6, 10**6], GREEDY, False),
            "bias": ([5, 6], dict(GREEDY, logit_bias={10**6: 1.0}), False),
            "user-error": ([5, 6], dict(GREEDY, max_tokens=0), False),
        }
        for rid, (prompt, params, remote) in sent.items():
            rig.send(Generate(request_id=rid, prompt=prompt, params=params, remote=remote, priority=0))
        answers = {m.request_id: m for m in rig.messages()}
        assert {rid: m.status for rid, m in answers.items()} == {
            "logprobs-remote": 500, "too-long": 500, "vocab": 500, "bias": 500, "user-error": 400}
        for rid in ("logprobs-remote", "too-long", "vocab", "bias"):
            assert answers[rid].error.startswith("internal error (a router bug): ") and answers[rid].param is None
        assert not rig.engine.has_unfinished()  # nothing was queued
    finally:
        rig.close()
