"""Speculative decoding's counters as metrics: their names, and vLLM's reader shapes.

One table of names for both front ends: the router's /metrics exposes a speculating
decode worker's counters under them (router/worker_metrics.py), and LLM.get_metrics()
returns the offline engine's in the shapes of vLLM's `LLM.get_metrics()` (Counter,
Vector). Torch-free, so that the router can import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.speculative.speculator import SpecStats

# SpecStats field -> (counter family name, help): exposed with the suffix _total.
SPEC_DECODE_COUNTERS = {
    "num_drafts": ("pdserve_spec_decode_num_drafts", "request steps that verified at least one draft token"),
    "num_draft_tokens": ("pdserve_spec_decode_num_draft_tokens", "draft tokens verified"),
    "num_accepted_tokens": ("pdserve_spec_decode_num_accepted_tokens", "draft tokens accepted"),
    "num_disabled": ("pdserve_spec_decode_num_disabled",
                     "requests that stopped speculating: their drafts were mostly rejected"),
}
# accepted_per_position[i], labelled position="i" (0: the first draft after a request's last token).
PER_POSITION = ("pdserve_spec_decode_num_accepted_tokens_per_pos", "draft tokens accepted, by position in the draft")


@dataclass
class Metric:
    """vLLM's reader shapes (vllm.v1.metrics.reader): a name and its labels."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Vector(Metric):
    """Counters in order: accepted tokens by draft position."""

    values: list[int]


def spec_decode_metrics(stats: SpecStats) -> list[Metric]:
    """The counters as vLLM's LLM.get_metrics() returns its own (names without _total)."""
    out: list[Metric] = [Counter(name, {}, getattr(stats, key)) for key, (name, _) in SPEC_DECODE_COUNTERS.items()]
    out.append(Vector(PER_POSITION[0], {}, list(stats.accepted_per_position)))
    return out
