"""Speculative decoding made observable: the offline LLM's stats() and get_metrics(),
the stats reply's typed counters (protocol SpecDecodeStats), the router's Prometheus
counters, the dashboard's panels, and `<pool>.engine.speculative_config` checked with
its path in the cluster config."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgpack
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import ClusterConfig, ConfigError
from engine import LLM, SamplingParams
from engine.speculative.metrics import PER_POSITION, SPEC_DECODE_COUNTERS, Counter, Vector
from engine.speculative.speculator import SpecStats
from protocol import WORKER_MESSAGES, MessageError, SpecDecodeStats, StatsReply, encode
from router.metrics import RouterMetrics
from tests.unit.test_grafana_dashboard import expressions, load_dashboard, metric_names
from tests.worker_stats import worker_stats

REPEATING = [[7, 8, 9, 10, 11] * 6, [3, 4] * 12 + [5]]  # n-grams find drafts here
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SPEC = {"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 7, "accepted_per_position": [4, 2, 1],
        "num_disabled": 1}


def samples(metrics: RouterMetrics) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}


@pytest.fixture(scope="module")
def speculating(llama_dir: Path) -> LLM:
    llm = LLM(str(llama_dir), num_kv_blocks=64, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                    "prompt_lookup_min": 1})
    llm.generate(REPEATING, GREEDY, use_tqdm=False)
    return llm


def test_llm_stats_and_get_metrics_count_the_drafts(speculating: LLM) -> None:
    spec = speculating.stats().spec
    assert spec == speculating.core.speculator.stats  # what the speculator counted, not a figure of its own
    assert spec.num_accepted_tokens > 0, "no draft was accepted: the test proves nothing"
    assert sum(spec.accepted_per_position) == spec.num_accepted_tokens and len(spec.accepted_per_position) == 3
    assert 0 < spec.acceptance_rate <= 1 and spec.mean_accepted_length > 1
    got = {m.name: m for m in speculating.get_metrics()}
    for key, (name, _) in SPEC_DECODE_COUNTERS.items():
        assert isinstance(got[name], Counter) and got[name].value == getattr(spec, key)
    per_position = got[PER_POSITION[0]]
    assert isinstance(per_position, Vector) and per_position.values == spec.accepted_per_position
    assert got["pdserve_spec_decode_num_accepted_tokens"].value == spec.num_accepted_tokens


def test_stats_are_a_copy_that_later_steps_leave_alone(speculating: LLM) -> None:
    before = speculating.stats().spec
    frozen = dataclasses.replace(before, accepted_per_position=list(before.accepted_per_position))
    speculating.generate(REPEATING[:1], GREEDY, use_tqdm=False)
    assert before == frozen and speculating.stats().spec.num_drafts > before.num_drafts


def test_without_speculation_there_is_nothing_to_report(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=16)
    assert llm.stats().spec is None and llm.get_metrics() == []


def test_the_engine_counters_are_what_the_stats_reply_carries() -> None:
    """decode_worker/server.py sends SpecDecodeStats(**dataclasses.asdict(SpecStats)):
    the protocol type must have every field of it, and the router read them back."""
    stats = SpecStats(num_drafts=2, num_draft_tokens=5, num_accepted_tokens=3, accepted_per_position=[2, 1, 0],
                      num_disabled=0)
    sent = StatsReply(seq=1, stats=worker_stats(spec_decode=SpecDecodeStats(**dataclasses.asdict(stats))))
    wire = WORKER_MESSAGES.decode(encode(sent)).stats.spec_decode
    assert dataclasses.asdict(stats) == {f: getattr(wire, f) for f in wire.__struct_fields__}


@pytest.mark.parametrize("bad,where", [({**SPEC, "num_drafts": True}, "num_drafts"),
                                       ({**SPEC, "accepted_per_position": [1, -1]}, "accepted_per_position"),
                                       ({k: v for k, v in SPEC.items() if k != "num_disabled"}, "num_disabled"),
                                       ([1, 2], "object")])
def test_malformed_counters_are_refused_by_name(bad, where: str) -> None:
    reply = msgspec.to_builtins(StatsReply(seq=1, stats=worker_stats()))
    reply["stats"]["spec_decode"] = bad
    with pytest.raises(MessageError, match=where) as refused:
        WORKER_MESSAGES.decode(msgpack.packb(reply))
    assert "$.stats.spec_decode" in str(refused.value)


def test_router_exposes_a_speculating_workers_counters_by_worker_role_and_position() -> None:
    m = RouterMetrics()
    m.set_worker("decode-0", "decode", worker_stats(running=1, spec_decode=SpecDecodeStats(**SPEC)))
    m.set_worker("decode-1", "decode", worker_stats(running=0))  # does not speculate
    got = samples(m)
    d = (("role", "decode"), ("worker", "decode-0"))
    assert got[("pdserve_spec_decode_num_drafts_total", d)] == 4
    assert got[("pdserve_spec_decode_num_draft_tokens_total", d)] == 12
    assert got[("pdserve_spec_decode_num_accepted_tokens_total", d)] == 7
    assert got[("pdserve_spec_decode_num_disabled_total", d)] == 1
    for position, count in enumerate(SPEC["accepted_per_position"]):
        assert got[("pdserve_spec_decode_num_accepted_tokens_per_pos_total", (("position", str(position)), *d))] == count
    assert not any(name.startswith("pdserve_spec_decode") and ("worker", "decode-1") in labels
                   for name, labels in got)
    assert got[("pdserve_worker_running", (("role", "decode"), ("worker", "decode-1")))] == 0

    # A later reply replaces the counts; one without them (restarted, not speculating) drops them.
    m.set_worker("decode-0", "decode", worker_stats(running=1, spec_decode=SpecDecodeStats(**{**SPEC, "num_drafts": 9})))
    assert samples(m)[("pdserve_spec_decode_num_drafts_total", d)] == 9
    m.set_worker("decode-0", "decode", worker_stats(running=1))
    got = samples(m)
    assert ("pdserve_spec_decode_num_drafts_total", d) not in got and ("pdserve_worker_running", d) in got


def test_the_dashboard_plots_acceptance_from_the_counters() -> None:
    read = {name for _, expr in expressions(load_dashboard()) for name in metric_names(expr)}
    for name in ("pdserve_spec_decode_num_accepted_tokens_total", "pdserve_spec_decode_num_draft_tokens_total",
                 "pdserve_spec_decode_num_drafts_total", "pdserve_spec_decode_num_accepted_tokens_per_pos_total"):
        assert name in read


MODEL = "models/SmolLM2-135M-Instruct"  # never loaded: the config is only checked


@pytest.mark.parametrize("spec,message", [
    ({"num_speculative_tokens": "3"}, "decode.engine.speculative_config.num_speculative_tokens: must be an integer"),
    ({"num_speculative_tokens": 0}, "decode.engine.speculative_config: num_speculative_tokens must be in [1, 16]"),
    ({"num_speculative_tokens": 2, "lookahead": 3}, "decode.engine.speculative_config.lookahead: unknown key"),
    ({"method": "ngram"}, "decode.engine.speculative_config.num_speculative_tokens: is required"),
    ([3], "decode.engine.speculative_config: must be a mapping"),
    ({"num_speculative_tokens": 2, "method": "eagle"}, "decode.engine.speculative_config: method must be one of"),
    ({"num_speculative_tokens": 2, "method": "draft_model"},
     "decode.engine.speculative_config: method 'draft_model' needs model"),
])
def test_a_bad_speculative_config_is_named_with_its_path(spec, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        ClusterConfig.from_dict({"model": MODEL, "decode": {"engine": {"speculative_config": spec}}})
    assert str(err.value).startswith(message), str(err.value)


def test_speculation_is_refused_on_the_prefill_pool_and_reaches_the_decode_engine() -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}
    with pytest.raises(ConfigError, match=r"^prefill\.engine\.speculative_config: a prefill worker never samples"):
        ClusterConfig.from_dict({"model": MODEL, "prefill": {"replicas": 1, "engine": {"speculative_config": spec}}})
    config = ClusterConfig.from_dict({"model": MODEL, "decode": {"engine": {"speculative_config": spec}}})
    decode = config.engine_config("decode").speculative_config
    assert (decode.method, decode.num_speculative_tokens, decode.prompt_lookup_max) == ("ngram", 3, 5)
    assert config.engine_config("prefill").speculative_config is None
