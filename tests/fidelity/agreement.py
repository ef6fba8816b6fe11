"""Teacher-forced agreement with float32 transformers, for what cannot be bit-exact
(an fp8 KV cache, fp8 weights): every position of fixed texts is scored with the
engine's prompt logprobs against HF's float32 log-softmax over the same tokens.

- top-1 agreement: the engine's most likely next token is HF's, over all positions
  and over the confident ones (HF's top token leads its runner-up by >= MARGIN nats,
  where a tie-break flip would be no error);
- mean |delta logprob| of the text's actual next token.
The bounds are in tolerances.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine import LLM, SamplingParams

MARGIN = 0.5  # nats: positions where HF's top-1 leads by at least this are "confident"

# Fixed texts of several kinds (prose, a how-to, code, a dialogue), written for these
# tests: about 600 positions in the demo model's tokenizer.
TEXTS = [
    "The river town woke slowly that morning. Fog lay over the water until nearly nine, and the "
    "ferry waited at the landing with its engine ticking. A woman in a green coat carried two "
    "baskets of apples down the ramp, set them beside the rail, and counted her change twice. "
    "Nobody spoke much. When the fog finally lifted, the far bank appeared all at once, bright "
    "and close, as if someone had pulled a curtain aside.",
    "To replace a bicycle tire, first open the brake so the wheel can pass between the pads. "
    "Loosen the axle nuts or the quick release, then lift the wheel out of the frame. Push one "
    "side of the tire toward the center of the rim and use two levers to work it over the edge. "
    "Remove the old tube, check the inside of the tire for glass or thorns, and fit the new tube "
    "with a little air in it so it does not twist.",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
    "    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n"
    "            out.append(a[i])\n            i += 1\n        else:\n            out.append(b[j])\n"
    "            j += 1\n    out.extend(a[i:])\n    out.extend(b[j:])\n    return out\n",
    "Customer: Hi, I ordered a lamp last week and it arrived with a cracked base.\n"
    "Agent: I'm sorry to hear that. Could you tell me the order number?\n"
    "Customer: Sure, it's 48213.\nAgent: Thank you. I can send a replacement today, or refund "
    "the full price if you prefer. Which would you like?\nCustomer: A replacement, please.",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts of plant "
    "cells, chlorophyll absorbs mostly red and blue light, and that energy splits water into "
    "oxygen, protons and electrons. The electrons pass along a chain of proteins that pumps "
    "protons across a membrane, and the resulting gradient drives the synthesis of ATP, which "
    "the Calvin cycle then spends to fix carbon dioxide into sugar.",
]


@dataclass(frozen=True)
class Agreement:
    positions: int
    confident: int  # positions where HF's top-1 leads by >= MARGIN
    top1_all: float  # fraction of all positions where the engine's top-1 is HF's
    top1_confident: float
    mean_abs_dlogprob: float  # of the text's actual next token

    def row(self, name: str) -> str:
        return (f"| {name} | {self.positions} | {self.top1_all:.2%} | {self.confident} | "
                f"{self.top1_confident:.2%} | {self.mean_abs_dlogprob:.4f} |")


def hf_log_softmax(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """[len - 1, vocab] float32: row j predicts token j + 1."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)


def reference(model_dir: Path, llm: LLM) -> list[tuple[list[int], torch.Tensor]]:
    """Each text's token ids and HF's float32 log-softmax over them."""
    out = []
    for text in TEXTS:
        ids = llm.tokenizer.encode(text)
        out.append((ids, hf_log_softmax(model_dir, ids)))
    return out


def measure(llm: LLM, ref: list[tuple[list[int], torch.Tensor]]) -> Agreement:
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    outs = llm.generate([ids for ids, _ in ref], params, use_tqdm=False)
    agree = agree_conf = confident = total = 0
    dlogprob = 0.0
    for out, (ids, hf) in zip(outs, ref):
        top2 = hf.topk(2, dim=-1)
        for j, entry in enumerate(out.prompt_logprobs[1:]):
            hf_top = int(top2.indices[j, 0])
            match = entry.top[0][0] == hf_top
            sure = float(top2.values[j, 0] - top2.values[j, 1]) >= MARGIN
            total += 1
            agree += match
            confident += sure
            agree_conf += match and sure
            dlogprob += abs(entry.logprob - float(hf[j, ids[j + 1]]))
    return Agreement(total, confident, agree / total, agree_conf / max(confident, 1), dlogprob / total)
