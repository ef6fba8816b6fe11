"""Which adapters hold the LoRA slots (engine/lora/slots.py): a running request holds
its adapter's; an idle slot goes to another adapter, least recently used first; an
adapter waiting for a slot is not overtaken by other adapters' requests; and a name
pointed at new files is a new adapter beside the old one."""

from __future__ import annotations

import pytest

from engine.lora.adapter import LoRAAdapter
from engine.lora.slots import LoRASlots
from engine.model.config import ModelConfig

CFG = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
                             "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2})


def adapters(names: str) -> dict[str, LoRAAdapter]:
    """Reads of adapters (no weights: nothing is written into a model here)."""
    return {n: LoRAAdapter(n, f"/adapters/{n}", 4, {}, digest=i) for i, n in enumerate(names)}


def test_a_waiting_adapter_gets_the_first_slot_that_drains() -> None:
    slots, a = LoRASlots({}, CFG, 2, 8, 8), adapters("abc")
    slots.begin_step()
    sa, sb = slots.take(a["a"]), slots.take(a["b"])
    assert {sa, sb} == {0, 1}
    assert slots.admits(a["a"])  # its adapter holds a slot
    assert not slots.admits(a["c"])  # every slot held: c waits ...
    assert not slots.admits(a["a"])  # ... and no other adapter overtakes it this step
    slots.begin_step()
    slots.release(sa)  # a's last request ends
    assert slots.admits(a["c"])
    assert slots.take(a["c"]) == sa and slots.held[sa] is a["c"]
    assert slots.take(a["b"]) == sb and slots.users[sb] == 2  # sharing a held slot


def test_idle_slots_go_least_recently_used_first_and_empty_ones_before() -> None:
    slots, a = LoRASlots({}, CFG, 3, 8, 8), adapters("abcd")
    s = [slots.take(a[n]) for n in "ab"]
    assert slots.held == [a["a"], a["b"], None]
    for slot in s:
        slots.release(slot)
    assert slots.take(a["c"]) == 2  # the empty slot first
    slots.release(2)
    assert slots.take(a["d"]) == s[0]  # then a's, used longest ago
    assert slots.take(a["b"]) == s[1]  # b's still there: not written again


def test_a_name_read_again_is_another_adapter() -> None:
    """Requests of the old read keep its slot; the new read gets a slot of its own."""
    slots = LoRASlots({}, CFG, 2, 8, 8)
    old, new = LoRAAdapter("x", "/v1", 4, {}, digest=1), LoRAAdapter("x", "/v2", 4, {}, digest=2)
    assert slots.take(old) != slots.take(new)
    assert old.cache_root != new.cache_root


def test_a_slot_released_more_often_than_taken_is_an_error() -> None:
    slots, a = LoRASlots({}, CFG, 1, 8, 8), adapters("a")
    slot = slots.take(a["a"])
    slots.release(slot)
    with pytest.raises(ValueError, match="released more often than it was taken"):
        slots.release(slot)
