"""Token controls (logit_bias, allowed_token_ids, bad_words) in SamplingParams and the
sampler: CPU, fixed seeds, fast."""

from __future__ import annotations

import msgspec
import pytest
import torch

from engine.request import Request
from engine.sampling import Sampler, SamplingRow, UnusableLogitsError, make_generator
from engine.sampling_params import SamplingParams, SamplingParamsError, bad_words_token_ids
from protocol.sampling import WireSamplingParams, from_wire, to_wire

EOS = 3
VOCAB = 50


def logits_row(top: int = 7, seed: int = 0) -> torch.Tensor:
    """[1, VOCAB] logits whose argmax is `top`, with a clear margin."""
    x = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(seed))
    x[0, top] = x.max() + 3.0
    return x


def draw(logits: torch.Tensor, params: SamplingParams, output=(), seed: int | None = None) -> list[int]:
    rows = [SamplingRow(params, [1, 2], list(output), make_generator(seed + i, "cpu") if seed is not None else None)
            for i in range(logits.shape[0])]
    return Sampler([EOS])(logits, rows).token_ids


def test_logit_bias_changes_the_argmax_greedy_and_sampled() -> None:
    x = logits_row(top=7)
    assert draw(x, SamplingParams(temperature=0.0)) == [7]
    assert draw(x, SamplingParams(temperature=0.0, logit_bias={"9": 100})) == [9]
    # JSON's string keys and ints are the same; a bias too small to matter changes nothing.
    assert draw(x, SamplingParams(temperature=0.0, logit_bias={9: 1e-3})) == [7]
    # Added to the logit, not set: +100 on a token far below still wins.
    many = x.expand(200, -1).clone()
    assert set(draw(many, SamplingParams(temperature=1.0, logit_bias={"9": 100}), seed=0)) == {9}


def test_logit_bias_minus_100_bans_a_token() -> None:
    x = logits_row(top=7)
    assert draw(x, SamplingParams(temperature=0.0, logit_bias={"7": -100})) != [7]
    many = x.expand(400, -1).clone()
    assert 7 in draw(many, SamplingParams(temperature=1.0), seed=0)
    assert 7 not in draw(many, SamplingParams(temperature=1.0, logit_bias={"7": -100}), seed=0)


def test_allowed_token_ids_restrict_what_is_drawn() -> None:
    x = logits_row(top=7).expand(300, -1).clone()
    allowed = [11, 12, 40]
    for temperature in (0.0, 1.0, 2.0):
        got = draw(x, SamplingParams(temperature=temperature, allowed_token_ids=allowed), seed=1)
        assert set(got) <= set(allowed)
    assert set(draw(x, SamplingParams(temperature=2.0, allowed_token_ids=allowed), seed=1)) == set(allowed)
    # Greedy: the best of the allowed.
    assert draw(x[:1], SamplingParams(temperature=0.0, allowed_token_ids=allowed)) == \
        [allowed[int(x[0, allowed].argmax())]]


def test_bad_words_ban_their_last_token_only_after_their_prefix() -> None:
    x = logits_row(top=7)
    params = SamplingParams(temperature=0.0, bad_words_token_ids=[[20, 21, 7]])
    assert draw(x, params, output=[]) == [7]
    assert draw(x, params, output=[21]) == [7]  # half a prefix
    assert draw(x, params, output=[20, 5, 21]) == [7]  # not at the end of the output
    assert draw(x, params, output=[1, 20, 21]) != [7]
    # A one-token bad word is banned at every step; the sampled path bans too.
    assert draw(x, SamplingParams(temperature=0.0, bad_words_token_ids=[[7]])) != [7]
    many = x.expand(300, -1).clone()
    assert 7 not in draw(many, SamplingParams(temperature=1.0, bad_words_token_ids=[[20, 7]]), output=[20], seed=0)


def test_controls_compose_in_a_batch_and_leave_other_rows_alone() -> None:
    x = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    plain = SamplingParams(temperature=0.0)
    params = [plain, SamplingParams(temperature=0.0, logit_bias={"5": 100}),
              SamplingParams(temperature=0.0, allowed_token_ids=[30, 31], logit_bias={"30": -100, "31": 0.5}),
              SamplingParams(temperature=0.0, bad_words_token_ids=[[int(x[3].argmax())]])]
    rows = [SamplingRow(p, [1], [], None) for p in params]
    got = Sampler([EOS])(x, rows).token_ids
    assert got[0] == int(x[0].argmax())
    assert got[1] == 5
    assert got[2] == 31
    assert got[3] == int(x[3].topk(2).indices[1])


def test_controls_that_leave_nothing_fail_their_row_alone() -> None:
    x = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4))
    dead = SamplingParams(temperature=0.7, allowed_token_ids=[8, 9], bad_words_token_ids=[[8], [9]])
    rows = [SamplingRow(SamplingParams(temperature=0.0), [1], [], None), SamplingRow(dead, [1], [], None),
            SamplingRow(SamplingParams(temperature=0.0, allowed_token_ids=[VOCAB - 1]), [1], [], None)]
    with pytest.raises(UnusableLogitsError) as info:
        Sampler([EOS])(x, rows)
    assert info.value.rows == [1]


def test_logprobs_describe_the_raw_distribution() -> None:
    x = logits_row(top=7)
    out = Sampler([EOS])(x, [SamplingRow(SamplingParams(temperature=0.0, logprobs=1, logit_bias={"9": 100}),
                                         [1], [], None)])
    raw = torch.log_softmax(x[0], -1)
    assert out.token_ids == [9]
    assert out.logprobs[0].logprob == pytest.approx(float(raw[9]), abs=1e-5)
    assert out.logprobs[0].top[0][0] == 7


def test_rows_without_controls_keep_the_fast_path() -> None:
    sampler = Sampler([EOS])
    plain = SamplingRow(SamplingParams(temperature=0.0), [1], [], None)
    controlled = SamplingRow(SamplingParams(temperature=0.0, logit_bias={"1": 1.0}), [1], [], None)
    assert plain.plain_greedy and not plain.has_controls
    assert controlled.has_controls and not controlled.plain_greedy
    sampler(logits_row(), [plain])
    assert plain.controls is None  # never built for a row without controls
    sampler(logits_row(), [controlled])
    assert controlled.controls is not None


@pytest.mark.parametrize("kwargs,param,message", [
    ({"logit_bias": {"5": 101}}, "logit_bias", "values must be in [-100, 100], got 101 for token 5"),
    ({"logit_bias": {"5": float("inf")}}, "logit_bias", "must be a finite number"),
    ({"logit_bias": {"5": "a"}}, "logit_bias", "must be a number, got 'a'"),
    ({"logit_bias": {"-1": 1}}, "logit_bias", "keys must be token ids"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "keys must be token ids"),
    ({"logit_bias": {"9" * 5000: 1}}, "logit_bias", "keys must be token ids"),
    ({"logit_bias": [1, 2]}, "logit_bias", "must be an object mapping token ids to biases"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "must be a non-empty list of token ids"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids", "must be a non-empty list of token ids"),
    ({"allowed_token_ids": [1, True]}, "allowed_token_ids", "must be a non-empty list of token ids"),
    ({"allowed_token_ids": ["1"]}, "allowed_token_ids", "must be a non-empty list of token ids"),
    ({"bad_words": [1]}, "bad_words", "must be a list of strings"),
    ({"bad_words": "Paris"}, "bad_words", "must be a list of strings"),  # a lone string is stop's shortcut only
    ({"bad_words": ["ok", "  "]}, "bad_words", "with some non-space text"),
    ({"bad_words": ["\ud800"]}, "bad_words", "valid Unicode"),
    ({"bad_words_token_ids": [[]]}, "bad_words_token_ids", "must be a list of non-empty lists of token ids"),
    ({"bad_words_token_ids": [1]}, "bad_words_token_ids", "must be a list of non-empty lists of token ids"),
])
def test_bad_token_controls_are_refused_naming_the_field(kwargs, param, message) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and message in str(info.value)


def test_token_controls_round_trip_the_wire_and_the_vocabulary_check() -> None:
    params = SamplingParams(logit_bias={"5": -100, 7: 2.5}, allowed_token_ids=[1, 5, 7], bad_words=["no"],
                            bad_words_token_ids=[[4, 5], [6]], n=2)
    assert params.logit_bias == {5: -100.0, 7: 2.5}
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(to_wire(params)), type=WireSamplingParams)
    assert from_wire(wire) == params
    assert params.child(1).bad_words_token_ids == [[4, 5], [6]]
    assert params.out_of_vocab(8) is None
    assert params.out_of_vocab(7) == ("logit_bias", [7])
    assert SamplingParams(allowed_token_ids=[3, 9, 10]).out_of_vocab(9) == ("allowed_token_ids", [9, 10])
    assert SamplingParams(bad_words_token_ids=[[1, 12]]).out_of_vocab(9) == ("bad_words", [12])
    # never matched, silently (found over HTTP: [1000000] was a 200)
    assert SamplingParams(stop_token_ids=[2, 10**6]).out_of_vocab(9) == ("stop_token_ids", [10**6])


def test_bad_words_tokenize_as_vllm_does() -> None:
    """Each word as it starts the text and, where that spells it with as many tokens
    and another first one, with a leading space."""
    table = {"foo": [1], " foo": [2], "a b": [3, 4], " a b": [5, 4], "xy": [6, 7], " xy": [8]}
    assert bad_words_token_ids(["foo", " a b", "xy"], table.__getitem__) == [[1], [2], [3, 4], [5, 4], [6, 7]]
    params = SamplingParams(bad_words=["foo"], bad_words_token_ids=[[2]])
    assert params.with_bad_words_tokenized(table.__getitem__).bad_words_token_ids == [[2], [1]]
    assert SamplingParams().with_bad_words_tokenized(table.__getitem__) == SamplingParams()


def test_only_multi_token_bad_words_make_sampling_read_the_history() -> None:
    """With async scheduling a step is queued before the previous token is on the host,
    unless the request's sampling reads the tokens so far."""
    assert Request("a", [1], SamplingParams(bad_words_token_ids=[[4, 5]])).reads_history_until == float("inf")
    assert Request("b", [1], SamplingParams(bad_words_token_ids=[[4]], logit_bias={1: 1})).reads_history_until == 0
    assert Request("c", [1], SamplingParams(allowed_token_ids=[1])).reads_history_until == 0
