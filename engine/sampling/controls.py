"""Token controls: allowed_token_ids, bad_words (as token sequences) and logit_bias,
applied by the sampler after a grammar's mask and before penalties (vLLM's order:
allowed ids -> bad words -> logit bias).

A request's fixed parts (its allowed-ids mask, its bias ids and values) are built on
the logits' device at its first sample and reused every step: a step then stacks them
for the rows that have them, one kernel per kind. Rows without controls are never
looked at here (SamplingRow.has_controls, read once per row when it is made).
Invariant: every id reaching a tensor here is inside the vocabulary (the engine
refuses others when a request is added; ids past the logits' width are dropped here
so that a bad id can never index out of bounds).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampling.pending import small_tensor
from engine.sampling_params import SamplingParams


@dataclass
class TokenControls:
    """One request's token controls, on one device, for a vocabulary of `vocab`."""

    vocab: int
    banned: torch.Tensor | None  # [vocab] bool on the device: outside allowed_token_ids; None: all allowed
    bias_ids: torch.Tensor | None  # [k] int64 on the device; None: no logit_bias
    bias_values: torch.Tensor | None  # [k] float32, the biases of bias_ids
    single_bans: list[int]  # one-token bad words: banned at every step
    prefixed_bans: list[tuple[tuple[int, ...], int]]  # (tokens before, last token) of longer ones

    @classmethod
    def build(cls, params: SamplingParams, vocab: int, device: torch.device) -> TokenControls:
        banned = None
        if params.allowed_token_ids is not None:
            banned = torch.ones(vocab, dtype=torch.bool, device=device)
            allowed = [t for t in params.allowed_token_ids if t < vocab]
            if allowed:  # none left: every token banned, and the row fails as unusable
                banned[small_tensor(device, allowed)] = False
        bias_ids = bias_values = None
        bias = {t: b for t, b in (params.logit_bias or {}).items() if t < vocab}
        if bias:
            bias_ids = small_tensor(device, list(bias))
            bias_values = small_tensor(device, list(bias.values()), torch.float32)
        seqs = [s for s in params.bad_words_token_ids if s[-1] < vocab]
        return cls(vocab, banned, bias_ids, bias_values,
                   sorted({s[0] for s in seqs if len(s) == 1}),
                   [(tuple(s[:-1]), s[-1]) for s in seqs if len(s) > 1])

    def bad_words_now(self, output: Sequence[int]) -> list[int]:
        """The tokens bad words ban after `output` (the tokens generated so far): a
        word's last token where the output ends with the tokens before it."""
        bans = list(self.single_bans)
        n = len(output)
        for prefix, last in self.prefixed_bans:
            k = len(prefix)
            if k <= n and output[n - 1] == prefix[-1] and tuple(output[n - k:]) == prefix:
                bans.append(last)
        return bans


def apply_token_controls(x: torch.Tensor, controls: list[TokenControls],
                         outputs: list[Sequence[int]], which: list[int]) -> None:
    """In place on x [batch, vocab] float32: row which[j] gets controls[j], its output
    so far outputs[j]."""
    dev = x.device
    allowed = [(which[j], c.banned) for j, c in enumerate(controls) if c.banned is not None]
    if allowed:
        idx = small_tensor(dev, [row for row, _ in allowed])
        mask = torch.stack([banned for _, banned in allowed])
        x.index_copy_(0, idx, x.index_select(0, idx).masked_fill_(mask, float("-inf")))
    rows: list[int] = []
    cols: list[int] = []
    for j, c in enumerate(controls):
        if c.single_bans or c.prefixed_bans:
            bans = c.bad_words_now(outputs[j])
            rows += [which[j]] * len(bans)
            cols += bans
    if rows:
        x[small_tensor(dev, rows), small_tensor(dev, cols)] = float("-inf")
    # bias_values is set with bias_ids (TokenControls.build).
    biased = [(which[j], c.bias_ids, c.bias_values) for j, c in enumerate(controls)
              if c.bias_ids is not None and c.bias_values is not None]
    if biased:
        counts = [ids.numel() for _, ids, _ in biased]
        bias_rows = torch.repeat_interleave(small_tensor(dev, [row for row, _, _ in biased]),
                                            small_tensor(dev, counts), output_size=sum(counts))
        bias_cols = torch.cat([ids for _, ids, _ in biased])
        bias_values = torch.cat([values for _, _, values in biased])
        # A row's ids are unique (dict keys): a gather and a put, no accumulating kernel.
        x.index_put_((bias_rows, bias_cols), x[bias_rows, bias_cols] + bias_values)
