"""Token controls through the offline LLM, against an oracle: HF transformers' logits
with the controls applied by hand at each greedy step (tiny seeded Llama, CPU), with
async scheduling off and on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams

MAX_TOKENS = 10
PROMPTS = [[5, 17, 42, 99, 7], [200, 13, 13, 64], [1, 300, 250, 8, 9, 77]]


@pytest.fixture(scope="module")
def hf(llama_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module", autouse=True)
def _restore_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def oracle(hf, prompt: list[int], bias: dict[int, float] | None = None, allowed: list[int] | None = None,
           bad: list[list[int]] = ()) -> list[int]:
    """Greedy tokens from HF's logits: allowed ids, then bad words (a word's last token
    where the output so far ends with the rest), then the bias added."""
    out: list[int] = []
    for _ in range(MAX_TOKENS):
        with torch.no_grad():
            x = hf(torch.tensor([prompt + out])).logits[0, -1].float()
        if allowed is not None:
            keep = x[allowed].clone()
            x[:] = float("-inf")
            x[allowed] = keep
        for word in bad:
            if len(word) == 1 or out[-(len(word) - 1):] == word[:-1]:
                x[word[-1]] = float("-inf")
        for token, b in (bias or {}).items():
            x[token] += b
        out.append(int(x.argmax()))
    return out


def greedy(**controls) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **controls)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_controls_match_hf_with_them_applied_by_hand(llama_dir: Path, hf, async_scheduling: bool) -> None:
    plain = [oracle(hf, p) for p in PROMPTS]
    a, b, c = plain
    # Each control chosen to change its prompt's greedy continuation.
    bias = {a[0]: -100.0, a[3]: 4.0}
    allowed = sorted({b[1], b[4], 11, 250, 383, 100})
    bad = [c[2:5], [c[6]], [c[0], c[0]]]  # three tokens, one, and a repeat
    want = [oracle(hf, PROMPTS[0], bias=bias), oracle(hf, PROMPTS[1], allowed=allowed),
            oracle(hf, PROMPTS[2], bad=bad)]
    assert all(w != p for w, p in zip(want, plain))
    llm = LLM(str(llama_dir), num_threads=1, async_scheduling=async_scheduling)
    params = [greedy(logit_bias={str(k): v for k, v in bias.items()}), greedy(allowed_token_ids=allowed),
              greedy(bad_words_token_ids=bad)]
    # In one batch with a plain request, which they leave alone.
    outs = llm.generate(PROMPTS + [PROMPTS[0]], params + [greedy()], use_tqdm=False)
    assert [o.token_ids for o in outs] == want + [a]
    kv = llm.core.kv
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_bad_words_are_tokenized_by_the_llm(llama_dir: Path, hf) -> None:
    """A bad word given as text is banned as the tokenizer spells it (with and without a
    leading space); a bad word past the vocabulary or without a tokenizer is refused."""
    llm = LLM(str(llama_dir), num_threads=1)
    tok = llm.tokenizer
    plain = oracle(hf, PROMPTS[0])
    word = tok.decode(plain[1:3])
    seqs = [tok.encode(word.lstrip(), add_special_tokens=False)]
    spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
    if spaced[0] != seqs[0][0] and len(spaced) == len(seqs[0]):
        seqs.append(spaced)
    want = oracle(hf, PROMPTS[0], bad=seqs)
    assert want != plain
    assert llm.generate([PROMPTS[0]], greedy(bad_words=[word]), use_tqdm=False)[0].token_ids == want


@pytest.mark.parametrize("controls,param", [
    ({"logit_bias": {"384": 1.0}}, "logit_bias"),
    ({"allowed_token_ids": [5, 384]}, "allowed_token_ids"),
    ({"bad_words_token_ids": [[5, 1000]]}, "bad_words"),
])
def test_ids_outside_the_vocabulary_are_refused_naming_the_field(llama_dir: Path, controls, param) -> None:
    llm = LLM(str(llama_dir), num_threads=1)
    with pytest.raises(ValueError, match=rf"^{param} token ids must be in \[0, 384\)"):
        llm.generate([PROMPTS[0], PROMPTS[1]], [greedy(), greedy(**controls)], use_tqdm=False)
    assert not llm.core.has_unfinished()
    assert llm.generate([PROMPTS[0]], greedy(), use_tqdm=False)[0].finish_reason == "length"


def test_controls_that_leave_nothing_fail_that_request(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), num_threads=1)
    dead = greedy(allowed_token_ids=[5, 6], bad_words_token_ids=[[5], [6]])
    with pytest.raises(Exception, match="nothing can be sampled"):
        llm.generate([PROMPTS[0]], dead, use_tqdm=False)
    assert not llm.core.has_unfinished()
