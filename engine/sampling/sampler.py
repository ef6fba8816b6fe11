"""Token sampler: grammar masks, token controls, penalties, min_tokens masking,
temperature, min_p/top_k/top_p, seeded draws.

Every batched tensor here is [batch, vocab] float32 on the logits' device; one token per row.
Order (vLLM): grammar mask -> allowed_token_ids -> bad_words -> logit_bias -> penalties ->
min_tokens mask -> temperature -> min_p -> top_k -> top_p -> sample. Logprobs always
describe the raw model distribution, before any of those steps.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.sampling.controls import TokenControls, apply_token_controls
from engine.sampling.pending import LogprobsQuery, PendingSample, SamplerOutput, small_tensor
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.structured.matcher import GrammarState

# Dividing by a temperature this small can overflow float32, so such rows go greedy (as vLLM).
_GREEDY_EPS = 1e-5


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """Per-request generator: a seeded request's draws then depend only on its own seed."""
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(seed)
    return gen


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated so far for this request
    generator: torch.Generator | None  # None = the sampler's shared generator
    grammar: GrammarState | None = None  # structured outputs: its matcher, at the tokens so far
    # Speculative decoding: a seeded row draws from a generator keyed on its seed and
    # output position, not from `generator` in turn. How many rows a request's steps
    # have depends on its drafts and on what else runs (the budget, free blocks); its
    # draws must not, so that a seeded request gives the same tokens in any batch.
    keyed_draws: bool = False
    # Greedy, and nothing but min_tokens alters the logits (read once per row per step).
    plain_greedy: bool = field(init=False)
    has_controls: bool = field(init=False)  # logit_bias, allowed_token_ids or bad_words
    controls: TokenControls | None = field(init=False, default=None)  # built at its first sample

    def __post_init__(self) -> None:
        self.has_controls = self.params.has_token_controls
        self.plain_greedy = (self.params.temperature < _GREEDY_EPS and not self.params.has_penalties
                             and not self.has_controls)

    def draw_generator(self) -> torch.Generator | None:
        """The generator this row draws from (None: the sampler's shared one)."""
        if not self.keyed_draws or self.generator is None:
            return self.generator
        key = hashlib.blake2b(f"{self.params.seed}:{len(self.output_token_ids)}".encode(), digest_size=8)
        return make_generator(int.from_bytes(key.digest(), "little") >> 1, self.generator.device)

    def after(self, drafts: Sequence[int]) -> SamplingRow:
        """This row as it will stand once `drafts` are accepted (speculative decoding:
        the row that verifies the draft after them)."""
        row = copy.copy(self)
        row.output_token_ids = [*self.output_token_ids, *drafts]
        if self.grammar is not None:
            row.grammar = self.grammar.after(drafts)
        return row


def _unusable(x: torch.Tensor) -> torch.Tensor:
    """[batch] bool: rows that would make softmax produce NaN (an upstream bug, not a
    sampling choice): any NaN, any +inf, or every token -inf.

    A row's max (which propagates NaN) is not finite exactly then: one pass over the
    logits, where testing each condition directly takes six.
    """
    return ~x.amax(-1).isfinite()


def _padded(seqs: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[n, max_len] int64 ids; padding and out-of-vocab ids point at a spare column `vocab`."""
    width = max(1, max(len(s) for s in seqs))
    ids = small_tensor(device, [list(s) + [vocab] * (width - len(s)) for s in seqs])
    return torch.where((ids >= 0) & (ids < vocab), ids, vocab)


class Sampler:
    """Draws one token per row from [batch, vocab] float32 logits (any device)."""

    def __init__(self, eos_token_ids: Sequence[int], seed: int = 0) -> None:
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.seed = seed
        # One shared generator per device, created lazily since the logits' device is unknown here.
        self._shared: dict[str, torch.Generator] = {}
        self._bitmask: Any = None  # engine.structured.bitmask.BitmaskBuffer, once a grammar is seen

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits: [len(rows), vocab] float32 (any device). One sampled token per row."""
        return self.sample(logits, rows).result()

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow],
               drafts: Sequence[int] | None = None) -> PendingSample:
        """Queue the sampling of one token per row on the logits' device and their copy
        to the host; nothing here waits for the device. PendingSample.result() does.

        `drafts` (speculative decoding): per row, the draft token it verifies, or -1.
        A greedy row accepts its draft if it is the argmax. A sampled row draws its
        token from its processed distribution p as without drafts and accepts the
        draft if that token is the draft: with probability p(draft), and on rejection
        the token is distributed as p without the draft, renormalised, which is
        rejection sampling against a draft proposed deterministically (Leviathan et
        al.; Chen et al.), so each token is distributed exactly as p. Either way the
        row's token is the draft when accepted, else the token drawn in its place."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], "
                             f"got {tuple(logits.shape)}")
        raw = logits.float()
        draft_t = None if drafts is None else small_tensor(raw.device, list(drafts))
        grammar_rows = [i for i, r in enumerate(rows) if r.grammar is not None]
        if not grammar_rows and all(r.plain_greedy and len(r.output_token_ids) >= r.params.min_tokens
                                    for r in rows):
            # Fast path: nothing alters the logits, so one batched argmax decides every row.
            token_ids = raw.argmax(dim=-1)
            return PendingSample(token_ids, _unusable(raw), self._logprobs(raw, rows),
                                 None if draft_t is None else token_ids == draft_t)

        greedy = [r.params.temperature < _GREEDY_EPS for r in rows]
        control_rows = [i for i, r in enumerate(rows) if r.has_controls]
        pen_rows = [i for i, r in enumerate(rows) if r.params.has_penalties]
        # A grammar decides when its row may stop: min_tokens does not hold it past its end
        # (where the grammar allows only a stop token, masking that would leave nothing).
        mask_rows = [i for i, r in enumerate(rows)
                     if len(r.output_token_ids) < r.params.min_tokens and r.grammar is None]
        x = raw.clone()  # the raw logits must survive for logprobs
        if grammar_rows:
            self._apply_grammars(x, rows, grammar_rows)
        if control_rows:
            self._apply_controls(x, rows, control_rows)
        if pen_rows:
            self._apply_penalties(x, rows, pen_rows)
        if mask_rows:
            self._mask_stops(x, rows, mask_rows)
        bad = _unusable(x)  # reported by result(): what is drawn from such a row is moot
        token_ids = x.argmax(dim=-1)
        accepted = None if draft_t is None else token_ids == draft_t
        sample_rows = [i for i, g in enumerate(greedy) if not g]
        if sample_rows:
            idx = small_tensor(x.device, sample_rows)
            sampled, unusable, sampled_accepted = self._sample(
                x.index_select(0, idx), [rows[i] for i in sample_rows],
                None if draft_t is None else draft_t.index_select(0, idx))
            token_ids.index_copy_(0, idx, sampled)
            bad.index_copy_(0, idx, bad.index_select(0, idx) | unusable)
            if accepted is not None:
                assert sampled_accepted is not None  # drawn against draft_t, as accepted was
                accepted.index_copy_(0, idx, sampled_accepted)
        return PendingSample(token_ids, bad, self._logprobs(raw, rows), accepted)

    def _apply_grammars(self, x: torch.Tensor, rows: list[SamplingRow], which: list[int]) -> None:
        """In place on x [batch, vocab]: each row in `which` keeps only what its grammar allows."""
        if self._bitmask is None:
            from engine.structured.bitmask import BitmaskBuffer  # imports xgrammar

            self._bitmask = BitmaskBuffer()
        self._bitmask.apply(x, [rows[i].grammar for i in which], which)

    def _apply_controls(self, x: torch.Tensor, rows: list[SamplingRow], which: list[int]) -> None:
        """In place on x [batch, vocab]: the token controls of the rows in `which`."""
        controls = []
        for i in which:
            row = rows[i]
            if row.controls is None or row.controls.vocab != x.shape[1]:
                row.controls = TokenControls.build(row.params, x.shape[1], x.device)
            controls.append(row.controls)
        apply_token_controls(x, controls,
                             [rows[i].output_token_ids for i in which], which)

    def _apply_penalties(self, x: torch.Tensor, rows: list[SamplingRow],
                         which: list[int]) -> None:
        """In place on x [batch, vocab]; only the rows in `which` are touched."""
        vocab, dev = x.shape[1], x.device
        sub = [rows[i].params for i in which]
        idx = small_tensor(dev, which)
        n = len(which)

        out_ids = _padded([rows[i].output_token_ids for i in which], vocab, dev)
        counts = torch.zeros(n, vocab + 1, device=dev).scatter_add_(
            1, out_ids, torch.ones_like(out_ids, dtype=torch.float32))[:, :vocab]
        prompt_ids = _padded([rows[i].prompt_token_ids for i in which], vocab, dev)
        seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=dev).scatter_(
            1, prompt_ids, True)[:, :vocab] | (counts > 0)

        def col(values: list[float]) -> torch.Tensor:
            return small_tensor(dev, values, torch.float32).unsqueeze(1)

        rep = col([p.repetition_penalty for p in sub])
        freq = col([p.frequency_penalty for p in sub])
        pres = col([p.presence_penalty for p in sub])
        y = x.index_select(0, idx)
        # Dividing a negative logit would raise its probability, hence multiply those instead.
        y = torch.where(seen, torch.where(y > 0, y / rep, y * rep), y)
        y = y - freq * counts - pres * (counts > 0).float()
        x.index_copy_(0, idx, y)

    def _mask_stops(self, x: torch.Tensor, rows: list[SamplingRow], which: list[int]) -> None:
        """Forbid eos and stop_token_ids for rows still short of min_tokens (in place)."""
        vocab = x.shape[1]
        r_idx: list[int] = []
        c_idx: list[int] = []
        for i in which:
            # eos is masked even with ignore_eos: min_tokens promises that many non-stop tokens.
            for t in set(self.eos_token_ids) | set(rows[i].params.stop_token_ids):
                if 0 <= t < vocab:
                    r_idx.append(i)
                    c_idx.append(t)
        if r_idx:
            x[small_tensor(x.device, r_idx), small_tensor(x.device, c_idx)] = float("-inf")

    def _sample(self, x: torch.Tensor, rows: list[SamplingRow], drafts: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x: [n, vocab] processed logits of non-greedy rows -> [n] int64 sampled ids,
        [n] bool: rows whose distribution came out unusable (NaN), reported like
        unusable logits rather than drawn from (argmax over NaN would pick a token),
        and with `drafts` ([n] int64, -1 = none) [n] bool: the draft was accepted (see
        sample())."""
        n, vocab = x.shape
        dev = x.device
        ps = [r.params for r in rows]

        def col(values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return small_tensor(dev, values, dtype).unsqueeze(1)

        x = x / col([p.temperature for p in ps])
        if any(p.min_p > 0 for p in ps):
            probs = x.softmax(-1)
            floor = probs.max(-1, keepdim=True).values * col([p.min_p for p in ps])
            x = x.masked_fill(probs < floor, float("-inf"))
        use_k = any(p.top_k > 0 for p in ps)
        use_p = any(p.top_p < 1.0 for p in ps)
        if use_k or use_p:
            # One descending sort serves both filters; results are scattered back afterwards.
            sx, order = x.sort(dim=-1, descending=True)
            if use_k:
                k = col([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in ps], torch.long)
                kth = sx.gather(1, k - 1)
                sx = sx.masked_fill(sx < kth, float("-inf"))  # ties with the k-th value stay
            if use_p:
                sp = sx.softmax(-1)
                before = sp.cumsum(-1) - sp  # mass strictly ahead of each token; 0 for the top
                top_p = col([p.top_p for p in ps])
                drop = (before >= top_p) & (top_p < 1.0)
                drop[:, 0] = False  # the top token always stays (top_p may round to 0 in float32)
                sx = sx.masked_fill(drop, float("-inf"))
            x = torch.empty_like(x).scatter_(1, order, sx)
        probs = x.softmax(-1)
        # Exponential race: argmax(p / E), E ~ Exp(1), draws token i with probability p_i.
        generators = [r.draw_generator() for r in rows]
        noise = self._noise(generators, n, vocab, dev)
        unusable = probs.isnan().any(-1)
        token_ids = (probs / noise).argmax(-1)
        # A draft is accepted exactly when the race draws it (probability p(draft)); on
        # rejection the race's token is distributed as p without the draft. The token
        # is the race's either way: with or without a draft, so a seeded row's tokens
        # do not depend on how many drafts its steps had.
        return token_ids, unusable, None if drafts is None else token_ids == drafts

    def _noise(self, generators: list[torch.Generator | None], n: int, vocab: int,
               dev: torch.device) -> torch.Tensor:
        """[n, vocab] Exp(1) noise; seeded rows draw exactly [vocab] each so batching can't
        shift their stream."""
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if len(unseeded) == n:
            noise = torch.empty(n, vocab, device=dev).exponential_(generator=self._shared_gen(dev))
        else:
            noise = torch.empty(n, vocab, device=dev)
            if unseeded:
                idx = small_tensor(dev, unseeded)
                draw = torch.empty(len(unseeded), vocab, device=dev)
                noise.index_copy_(0, idx, draw.exponential_(generator=self._shared_gen(dev)))
            for i, g in enumerate(generators):
                if g is not None:
                    noise[i] = torch.empty(vocab, device=g.device).exponential_(generator=g).to(dev)
        # A zero draw would turn 0/0 into NaN, which argmax treats as the maximum.
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)

    def _shared_gen(self, dev: torch.device) -> torch.Generator:
        key = str(dev)
        if key not in self._shared:
            self._shared[key] = make_generator(self.seed, dev)
        return self._shared[key]

    def _logprobs(self, raw: torch.Tensor, rows: list[SamplingRow]) -> LogprobsQuery | None:
        """Raw-distribution log-softmax of the rows that asked for logprobs (the chosen
        tokens' entries are gathered once they are drawn: PendingSample)."""
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not want:
            return None
        lp = torch.log_softmax(raw.index_select(0, small_tensor(raw.device, want)), dim=-1)
        k = min(max(rows[i].params.logprobs or 0 for i in want), raw.shape[1])
        return LogprobsQuery(want, [rows[i].params.logprobs or 0 for i in want], lp, k)
