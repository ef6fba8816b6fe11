"""Unit tests for engine.sampling.Sampler (CPU, fixed seeds, fast)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampling import Sampler, SamplingRow, make_generator
from engine.sampling_params import SamplingParams, SamplingParamsError

EOS = 3


def row(params: SamplingParams, prompt=(), output=(), seed: int | None = None) -> SamplingRow:
    gen = make_generator(seed, "cpu") if seed is not None else None
    return SamplingRow(params, list(prompt), list(output), gen)


def greedy_token(logits: list[float], **kw) -> int:
    params = SamplingParams(temperature=0.0, **{k: v for k, v in kw.items()
                                                if k not in ("prompt", "output")})
    r = row(params, kw.get("prompt", ()), kw.get("output", ()))
    return Sampler([EOS])(torch.tensor([logits]), [r]).token_ids[0]


def counts_of(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """Draw n tokens from one logits vector in a single batched call; returns per-token counts."""
    out = Sampler([EOS], seed=seed)(logits.expand(n, -1), [row(params) for _ in range(n)])
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits.shape[-1])


def test_greedy_equals_argmax():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0))
    rows = [row(SamplingParams(temperature=0.0)) for _ in range(8)]
    assert Sampler([EOS])(logits, rows).token_ids == logits.argmax(-1).tolist()
    # Greedy rows mixed with sampled rows take the slow path and must still be argmax.
    mixed = rows[:4] + [row(SamplingParams(temperature=1.0), seed=i) for i in range(4)]
    assert Sampler([EOS])(logits, mixed).token_ids[:4] == logits[:4].argmax(-1).tolist()


def test_seeded_reproducible_across_batch_composition_and_position():
    logits = torch.zeros(1, 50)  # uniform, so every draw really depends on the noise
    params = SamplingParams(temperature=1.0, seed=123)
    alone_gen, batched_gen = make_generator(123, "cpu"), make_generator(123, "cpu")
    alone, batched = [], []
    others = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    sampler = Sampler([EOS], seed=7)
    for step in range(20):
        alone.append(sampler(logits, [SamplingRow(params, [], [], alone_gen)]).token_ids[0])
        pos = step % 4  # move the seeded row around the batch
        batch_rows = [row(SamplingParams(temperature=0.7, top_k=5), seed=99 + step),
                      row(SamplingParams(temperature=1.3)), row(SamplingParams(temperature=0.0))]
        batch_rows.insert(pos, SamplingRow(params, [], [], batched_gen))
        batch_logits = torch.cat([others[:pos], logits, others[pos:]])
        batched.append(sampler(batch_logits, batch_rows).token_ids[pos])
    assert alone == batched
    assert len(set(alone)) > 5


def test_different_seeds_differ():
    logits = torch.zeros(1, 50)
    params = SamplingParams(temperature=1.0)
    seqs = []
    for seed in (1, 2):
        gen = make_generator(seed, "cpu")
        seqs.append([Sampler([EOS])(logits, [SamplingRow(params, [], [], gen)]).token_ids[0]
                     for _ in range(50)])
    same = sum(a == b for a, b in zip(*seqs))
    assert same < 10  # ~1 expected by chance on a uniform 50-way draw


def test_top_k_one_equals_greedy():
    logits = torch.randn(16, 200, generator=torch.Generator().manual_seed(2))
    rows = [row(SamplingParams(temperature=1.5, top_k=1), seed=i) for i in range(16)]
    assert Sampler([EOS])(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_top_k_keeps_only_k_best():
    logits = torch.tensor([[3.0, 2.9, 2.8, 2.7, 2.6]])
    c = counts_of(logits, SamplingParams(temperature=1.0, top_k=2), 2000)
    assert c[2:].sum() == 0 and c[0] > 0 and c[1] > 0


def test_top_p_tiny_equals_greedy():
    logits = torch.randn(16, 200, generator=torch.Generator().manual_seed(3))
    rows = [row(SamplingParams(temperature=1.5, top_p=1e-6), seed=i) for i in range(16)]
    assert Sampler([EOS])(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    # 0.5 + 0.3 = 0.8 >= 0.75, so only tokens 0 and 1 survive.
    c = counts_of(logits, SamplingParams(temperature=1.0, top_p=0.75), 2000)
    assert c[2:].sum() == 0 and c[1] > 0


def test_min_p_filters():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    # min_p 0.2 -> floor 0.1: token 3 (0.05) is dropped, token 2 (0.15) kept.
    c = counts_of(logits, SamplingParams(temperature=1.0, min_p=0.2), 3000)
    assert c[3] == 0 and c[2] > 0
    assert counts_of(logits, SamplingParams(temperature=1.0), 3000)[3] > 0


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_temperature_frequencies_match_softmax():
    logits = torch.tensor([[0.2, 0.3, 0.5]]).log()
    n, temp = 20000, 2.0
    c = counts_of(logits, SamplingParams(temperature=temp), n, seed=11).float()
    target = torch.softmax(logits[0] / temp, -1)
    assert chi_square(c, target) < 13.8  # chi2, 2 dof, p = 0.001
    # The untempered distribution must be clearly rejected, else temperature was ignored.
    assert chi_square(c, torch.softmax(logits[0], -1)) > 100


def test_repetition_penalty():
    logits = [2.0, 1.9, 0.0]
    assert greedy_token(logits) == 0
    assert greedy_token(logits, repetition_penalty=2.0, prompt=[0]) == 1  # 2.0 / 2 < 1.9
    assert greedy_token(logits, repetition_penalty=2.0, output=[0]) == 1
    neg = [-1.0, -1.2, -5.0]
    # Negative logits get multiplied: -1.5 < -1.2. Dividing (-0.67) would keep token 0.
    assert greedy_token(neg, repetition_penalty=1.5, prompt=[0]) == 1


def test_presence_penalty_applies_once_to_output_only():
    logits = [1.0, 0.5]
    assert greedy_token(logits, presence_penalty=0.6, output=[0]) == 1
    # Subtracted once, not per occurrence: 1.0 - 0.4 = 0.6 > 0.5.
    assert greedy_token(logits, presence_penalty=0.4, output=[0, 0, 0]) == 0
    assert greedy_token(logits, presence_penalty=2.0, prompt=[0]) == 0


def test_frequency_penalty_scales_with_count():
    logits = [1.0, 0.5]
    # 1.0 - 3 * 0.2 = 0.4 < 0.5; a once-only penalty would leave 0.8.
    assert greedy_token(logits, frequency_penalty=0.2, output=[0, 0, 0]) == 1
    assert greedy_token(logits, frequency_penalty=0.2, output=[0]) == 0
    assert greedy_token(logits, frequency_penalty=2.0, prompt=[0]) == 0


def test_min_tokens_masks_eos_and_stop_ids():
    logits = [0.0, 1.0, 2.0, 3.0]  # EOS=3 best, stop id 2 next, then 1
    kw = dict(min_tokens=2, max_tokens=4, stop_token_ids=[2])
    assert greedy_token(logits, output=[5], **kw) == 1
    assert greedy_token(logits, output=[5], ignore_eos=True, **kw) == 1
    assert greedy_token(logits, output=[5, 5], **kw) == EOS
    # The mask must hold for sampled rows too.
    c = counts_of(torch.tensor([logits]), SamplingParams(temperature=1.0, **kw), 1000)
    assert c[2] == 0 and c[3] == 0


def test_logprobs_are_raw_and_top_sorted():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(4))
    rows = [row(SamplingParams(temperature=0.7, logprobs=5, repetition_penalty=1.3,
                               presence_penalty=0.5), prompt=[1, 2], output=[3], seed=0),
            row(SamplingParams(temperature=0.0)),
            row(SamplingParams(temperature=0.0, logprobs=0))]
    out = Sampler([EOS])(logits, rows)
    raw = torch.log_softmax(logits, -1)
    lp = out.logprobs[0]
    assert lp is not None and lp.token_id == out.token_ids[0]
    assert math.isclose(lp.logprob, raw[0, lp.token_id].item(), rel_tol=1e-5, abs_tol=1e-6)
    assert [t for t, _ in lp.top] == raw[0].topk(5).indices.tolist()
    vals = [v for _, v in lp.top]
    assert vals == sorted(vals, reverse=True)
    assert torch.allclose(torch.tensor(vals), raw[0].topk(5).values)
    assert out.logprobs[1] is None
    assert out.logprobs[2] is not None and out.logprobs[2].top == []
    assert math.isclose(out.logprobs[2].logprob, raw[2].max().item(), rel_tol=1e-5)


def test_never_samples_masked_tokens_or_nan():
    logits = torch.full((1, 30), float("-inf"))
    logits[0, [4, 17]] = torch.tensor([0.0, -50.0])
    c = counts_of(logits, SamplingParams(temperature=1.0), 2000)
    assert c.sum() == 2000 and c[4] + c[17] == 2000


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0),
                                    SamplingParams(temperature=1.0, top_p=0.9)])
def test_all_neg_inf_row_raises(params):
    logits = torch.randn(2, 10)
    logits[1] = float("-inf")
    with pytest.raises(RuntimeError, match="-inf"):
        Sampler([EOS])(logits, [row(params), row(params)])


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0),
                                    SamplingParams(temperature=1.0, top_p=0.9)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_pos_inf_logit_raises_naming_the_row(params, bad):
    logits = torch.randn(3, 10)
    logits[2, 5] = bad
    logits[1, 0] = float("-inf")  # one -inf among finite logits is fine
    with pytest.raises(RuntimeError, match=r"rows \[2\]"):
        Sampler([EOS])(logits, [row(params) for _ in range(3)])


def test_min_tokens_masking_everything_raises():
    logits = torch.full((1, 4), float("-inf"))
    logits[0, EOS] = 1.0
    with pytest.raises(RuntimeError):
        Sampler([EOS])(logits, [row(SamplingParams(temperature=0.0, min_tokens=1))])


@pytest.mark.parametrize("kwargs,param,message", [
    (dict(max_tokens="10"), "max_tokens", "max_tokens must be an integer, got '10'"),
    (dict(max_tokens=True), "max_tokens", "max_tokens must be an integer, got True"),
    (dict(temperature="hot"), "temperature", "temperature must be a number, got 'hot'"),
    (dict(temperature=float("nan")), "temperature", "temperature must be a finite number"),
    (dict(top_p=float("inf")), "top_p", "top_p must be a finite number"),
    (dict(stop=5), "stop", "stop must be a string or a list of strings, got 5"),
    (dict(seed=2**70), "seed", "seed must be an integer in ["),
    (dict(min_tokens=5, max_tokens=3), "min_tokens", "min_tokens must be in [0, max_tokens=3], got 5"),
    (dict(repetition_penalty=1e-38), "repetition_penalty", "repetition_penalty must be in [0.01, 100]"),
    (dict(ignore_eos=1), "ignore_eos", "ignore_eos must be a boolean, got 1"),
])
def test_sampling_params_check_types_before_ranges_and_name_the_field(kwargs, param, message):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param and message in str(err.value)



def test_a_top_p_that_rounds_to_zero_keeps_the_top_token() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    out = Sampler([])(logits, [row(SamplingParams(temperature=1.0, top_p=1e-50, seed=1))])
    assert out.token_ids == [1]  # nothing else survives top_p; the top token is never dropped


def test_a_distribution_that_turns_nan_is_reported_not_drawn_from() -> None:
    """A temperature beyond float32 turns masked (-inf) logits into NaN: the row is
    unusable, as NaN logits are, instead of silently yielding token 0."""
    logits = torch.tensor([[0.0, 3.0, float("-inf"), 2.0]])
    with pytest.raises(RuntimeError, match="unusable logits in batch rows \\[0\\]"):
        Sampler([])(logits, [row(SamplingParams(temperature=1e39, seed=1))])
