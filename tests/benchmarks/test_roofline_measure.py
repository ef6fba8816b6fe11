"""benchmarks/offline/roofline/measure.py on a tiny engine: decode windows at a steady batch
leave the engine empty, and a prefill step computes exactly its chunk after a cached
context (or says why not)."""

from __future__ import annotations

import pytest

from benchmarks.offline.roofline.measure import decode_steps, make_engine, prefill_steps
from tests.tiny_models import VOCAB_SIZE, build_tiny_model


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory):
    model = build_tiny_model("llama", tmp_path_factory.mktemp("roofline") / "llama")
    return make_engine(str(model), "cpu", "float32", max_batch=2, max_tokens=64, kv_gib=0.01).core


def test_decode_steps(core) -> None:
    rows = decode_steps(core, "cpu", [1, 2], [8], VOCAB_SIZE, steps=2, windows=2)
    assert [(m.kind, m.batch, m.context) for m in rows] == [("decode", 1, 8), ("decode", 2, 8)]
    # A settling step at context 8, then 2 windows of 2 steps at contexts 9..12.
    assert all(m.timed_contexts == (9, 10, 11, 12) and m.seconds > 0 for m in rows)
    assert not core.has_unfinished()


def test_every_timed_decode_step_runs_the_whole_batch(core, monkeypatch: pytest.MonkeyPatch) -> None:
    """More timed steps than a request's default 63: the batch must not drain while timed
    (the floor assumes the whole batch in every step)."""
    sizes: list[int] = []
    step = core.step

    def counted():
        out = step()
        sizes.append(out.num_requests)
        return out

    monkeypatch.setattr(core, "step", counted)
    decode_steps(core, "cpu", [2], [8], VOCAB_SIZE, steps=20, windows=4)
    timed = sizes[-80:]  # the last 80 steps are the 4 timed windows
    assert timed == [2] * 80, f"{timed.count(0)} of 80 timed steps ran an empty batch"


def test_prefill_step_after_a_cached_context(core) -> None:
    m = prefill_steps(core, "cpu", chunk=24, context=16, vocab=VOCAB_SIZE, repeats=2)
    assert (m.kind, m.batch, m.new_tokens, m.context, m.timed_contexts) == ("prefill", 1, 24, 16, (16,))
    assert m.seconds > 0 and not core.has_unfinished()


def test_prefill_context_off_the_block_grid_is_refused(core) -> None:
    with pytest.raises(RuntimeError, match="computed 32 tokens, not the 24-token chunk after a 8-token"):
        prefill_steps(core, "cpu", chunk=24, context=8, vocab=VOCAB_SIZE, repeats=1)
