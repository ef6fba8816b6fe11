"""Rules the router owns for every served request, guarded where a decode worker
takes one.

The router is the one owner of three rules: a prompt whose prompt logprobs are asked
is prefilled locally (router/core.py Router._submit decides `remote`), prompt +
max_tokens fit the context length (router/parsing.py), and every token id is in the
vocabulary (router/request_body.py). A Generate that breaks one can only come from a
router bug (the worker plane is authenticated, security/), so the decode worker refuses
it as an internal error (status 500), never as a second message to the user. The
engine's own checks of these rules answer offline callers (engine/llm.py); on a served
request this guard runs first, so they are never reached.
"""

from __future__ import annotations

from engine.sampling_params import SamplingParams


class RouterBug(Exception):
    """A served request broke a rule the router owns: the router's bug, not the user's."""


def check_router_rules(prompt: list[int], params: SamplingParams, remote: bool, max_model_len: int,
                       vocab_size: int) -> None:
    """Raise RouterBug naming the first rule the request breaks."""
    if remote and params.prompt_logprobs is not None:
        raise RouterBug("a remote prefill was asked for a prompt with prompt_logprobs, which must be "
                        "prefilled locally (its logits are needed here)")
    if len(prompt) + params.max_tokens > max_model_len:
        raise RouterBug(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                        f"context length {max_model_len}")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise RouterBug(f"prompt token ids must be integers in [0, {vocab_size}), got {bad[:5]}")
    outside = params.out_of_vocab(vocab_size)
    if outside is not None:
        raise RouterBug(f"{outside[0]} token ids must be in [0, {vocab_size}), got {outside[1]}")
