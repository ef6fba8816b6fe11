"""The typed messages: one wire form each, and a clear refusal of anything else."""

from __future__ import annotations

import msgpack
import pytest

from engine.sampling_params import SamplingParams, SamplingParamsError
from protocol import (
    CONTROL_MESSAGES,
    PROTOCOL_VERSION,
    WORKER_MESSAGES,
    Abort,
    Generate,
    MessageError,
    Peers,
    PrefillDone,
    Ready,
    Rejected,
    RemotePrefill,
    Serving,
    SpecDecodeStats,
    Stats,
    StatsReply,
    StepTimes,
    Stop,
    Tokens,
    encode,
    from_wire,
    to_wire,
)
from tests.worker_stats import worker_stats

WORKER = [
    Generate(request_id="a", prompt=[1, 2, 3], params=to_wire(SamplingParams(max_tokens=4, stop=["x"], seed=2**64 - 1)),
             remote=True, priority=2, queue_tag=1.5),
    Abort(request_id="a"),
    Stats(seq=7),
    StatsReply(seq=7, stats=worker_stats(name="decode-0", remote=3, kv_transfer_seconds=0.5, spec_decode=SpecDecodeStats(
        num_drafts=1, num_draft_tokens=2, num_accepted_tokens=1, accepted_per_position=[1, 0], num_disabled=0)),
               kv_events=[(2**64 - 1, 0, True), (3, 2, False), (4, 3, True)], kv_reset=True),
    StatsReply(seq=8, stats=worker_stats(name="prefill-0", jobs=2, tokens_computed=512, step_seconds_by_tokens=StepTimes(
        bounds=[16.0, 256.0], counts=[0, 3, 1], sizes=[0.0, 120.0, 300.0], seconds=[0.0, 0.03, 0.05]))),
    Tokens(request_id="a", tokens=[5], finished=True, reason="length", cached=16,
           logprobs=[(-0.5, [(5, -0.5), (6, -1.25)])], phases={"queue": 0.25}),
    Rejected(request_id="a", error="bad", status=400),
    RemotePrefill(request_id="a", prompt_token_ids=[1, 2], peer="decode-0", block_ids=[4, 5], first_block=1,
                  epoch=3, deadline=1.5e9, session="s", priority=-1, queue_tag=2.25),
    PrefillDone(request_id="a", error=None, compute_s=0.5, transfer_s=0.25, bytes_written=4096),
]
CONTROL = [Ready(name="decode-0", address="tcp://127.0.0.1:1", metadata=b"\x00\x01"),
           Peers(prefill={"prefill-0": "tcp://127.0.0.1:2"}), Peers(decode=[b"meta"]), Serving(cold=["x"]), Stop()]


@pytest.mark.parametrize("message", WORKER, ids=lambda m: m.kind)
def test_every_worker_message_comes_back_as_it_was_sent(message) -> None:
    assert WORKER_MESSAGES.decode(encode(message)) == message


@pytest.mark.parametrize("message", CONTROL, ids=lambda m: m.kind)
def test_every_control_message_comes_back_as_it_was_sent(message) -> None:
    assert CONTROL_MESSAGES.decode(encode(message)) == message


def raw(kind: str, **fields) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "kind": kind, **fields})


def refusal(data: bytes) -> MessageError:
    with pytest.raises(MessageError) as refused:
        WORKER_MESSAGES.decode(data)
    return refused.value


def test_a_bool_is_not_an_int_and_the_field_is_named() -> None:
    error = refusal(raw("stats", seq=True))
    assert "Expected `int`, got `bool`" in str(error) and "$.seq" in str(error) and error.kind == "stats"


def test_unknown_and_missing_fields_are_refused() -> None:
    assert "unknown field `extra`" in str(refusal(raw("abort", request_id="a", extra=1)))
    assert "missing required field `request_id`" in str(refusal(raw("abort")))


def test_another_version_is_refused_by_its_number_first() -> None:
    error = refusal(msgpack.packb({"v": 6, "kind": "tokens", "id": "a"}))
    assert f"protocol version 6, this side speaks {PROTOCOL_VERSION}" in str(error)


def test_garbage_and_unknown_kinds_are_refused() -> None:
    assert refusal(b"\xc1 not msgpack").kind is None
    assert "Invalid value 'shutdown'" in str(refusal(raw("shutdown")))
    assert refusal(msgpack.packb([1, 2])).request_id is None


def test_sampling_params_travel_whole_and_are_checked_where_they_are_rebuilt() -> None:
    params = SamplingParams(max_tokens=7, temperature=0.5, stop="x", seed=2**64 - 1, logprobs=3)
    generate = WORKER_MESSAGES.decode(encode(Generate(request_id="r", prompt=[1], params=to_wire(params),
                                                      remote=False)))
    assert from_wire(generate.params) == params
    # Missing fields take SamplingParams' defaults; a value out of range names its field.
    sent = WORKER_MESSAGES.decode(raw("generate", request_id="r9", prompt=[1], params={"max_tokens": 0},
                                      remote=False, priority=0))
    with pytest.raises(SamplingParamsError, match="max_tokens must be an integer >= 1, got 0"):
        from_wire(sent.params)


def test_an_unknown_sampling_parameter_is_refused_and_the_request_named() -> None:
    error = refusal(raw("generate", request_id="r9", prompt=[1], params={"temprature": 0.5}, remote=False,
                        priority=0))
    assert "unknown field `temprature`" in str(error) and "$.params" in str(error)
    assert (error.kind, error.request_id) == ("generate", "r9")


def test_a_sampling_parameter_of_the_wrong_type_is_refused_on_arrival_and_the_request_named() -> None:
    # Typed on the wire as in SamplingParams: a string, a bool or a float where an int goes
    # fails to decode, naming the field, and the worker can still answer request r9.
    for name, value, expected in (("max_tokens", "7", "int"), ("top_k", True, "int"), ("seed", 1.5, "int | null"),
                                  ("stop", [1], "str"), ("logit_bias", {"x": 1.0}, "int")):
        error = refusal(raw("generate", request_id="r9", prompt=[1], params={name: value}, remote=False,
                            priority=0))
        assert f"Expected `{expected}`" in str(error) and f"$.params.{name}" in str(error), str(error)
        assert (error.kind, error.request_id) == ("generate", "r9")
    # A structured-outputs request crosses as the map of its one key.
    params = SamplingParams(structured_outputs={"regex": "[ab]+"})
    sent = WORKER_MESSAGES.decode(encode(Generate(request_id="r", prompt=[1], params=to_wire(params), remote=False)))
    assert sent.params.structured_outputs == {"regex": "[ab]+"} and from_wire(sent.params) == params


@pytest.mark.parametrize("tag", [-1.0, float("nan"), float("inf")])
def test_a_queue_tag_that_is_negative_or_not_finite_is_refused_by_name(tag: float) -> None:
    """A nan or inf tag would break every worker queue's order: refused on arrival."""
    generate = msgpack.unpackb(encode(WORKER[0]))
    prefill = msgpack.unpackb(encode(next(m for m in WORKER if isinstance(m, RemotePrefill))))
    for message in (generate, prefill):
        error = refusal(msgpack.packb({**message, "queue_tag": tag}))
        assert "queue_tag" in str(error) and error.kind == message["kind"] and error.request_id == "a"
    with pytest.raises(ValueError, match="queue_tag"):
        Generate(request_id="a", prompt=[1], params=to_wire(SamplingParams()), remote=False, queue_tag=float("inf"))


def test_the_fair_queuing_fields_default_for_a_sender_that_leaves_them_out() -> None:
    generate = msgpack.unpackb(encode(WORKER[0]))
    del generate["queue_tag"]
    assert WORKER_MESSAGES.decode(msgpack.packb(generate)).queue_tag == 0.0
    prefill = msgpack.unpackb(encode(next(m for m in WORKER if isinstance(m, RemotePrefill))))
    del prefill["priority"], prefill["queue_tag"]
    decoded = WORKER_MESSAGES.decode(msgpack.packb(prefill))
    assert (decoded.priority, decoded.queue_tag) == (0, 0.0)


def test_a_control_message_is_not_a_worker_message() -> None:
    with pytest.raises(MessageError):
        WORKER_MESSAGES.decode(encode(Stop()))


def test_worker_stats_carry_only_their_roles_fields_and_each_is_checked_by_name() -> None:
    reply = StatsReply(seq=1, stats=worker_stats(name="prefill-0", jobs=2))
    sent = msgpack.unpackb(encode(reply))["stats"]
    assert sent["jobs"] == 2 and "remote" not in sent and "spec_decode" not in sent  # a decode worker's
    assert WORKER_MESSAGES.decode(encode(reply)).stats.remote is None
    sent["running"] = -1
    error = refusal(raw("stats_reply", seq=1, stats=sent))
    assert "Expected `int` >= 0" in str(error) and "$.stats.running" in str(error) and error.kind == "stats_reply"
    del sent["running"]
    assert "missing required field `running` - at `$.stats`" in str(refusal(raw("stats_reply", seq=1, stats=sent)))
