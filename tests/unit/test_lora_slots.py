"""Which adapters hold the LoRA slots (engine/lora/slots.py): a running request holds
its adapter's; an idle slot goes to another adapter, least recently used first; and an
adapter waiting for a slot is not overtaken by other adapters' requests."""

from __future__ import annotations

from engine.lora.adapter import LoRAAdapter
from engine.lora.request import LoRARequest
from engine.lora.slots import LoRASlots
from engine.model.config import ModelConfig

CFG = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
                             "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2})


def slots_with(names: str, max_loras: int = 2) -> tuple[LoRASlots, dict[str, LoRARequest]]:
    slots = LoRASlots({}, CFG, max_loras, 8, 8)
    adapters = {n: LoRARequest(n, i + 1, f"/adapters/{n}") for i, n in enumerate(names)}
    for n, lora in adapters.items():  # read already: nothing touches the disk
        slots.loaded[n] = LoRAAdapter(n, lora.lora_path, 4, {})
    return slots, adapters


def test_a_waiting_adapter_gets_the_first_slot_that_drains() -> None:
    slots, a = slots_with("abc")
    slots.begin_step()
    sa, sb = slots.take(a["a"]), slots.take(a["b"])
    assert {sa, sb} == {0, 1}
    assert slots.admits(a["a"])  # its adapter holds a slot
    assert not slots.admits(a["c"])  # every slot held: c waits ...
    assert not slots.admits(a["a"])  # ... and no other adapter overtakes it this step
    slots.begin_step()
    slots.release(sa)  # a's last request ends
    assert slots.admits(a["c"])
    assert slots.take(a["c"]) == sa and slots.names[sa] == "c"
    assert slots.take(a["b"]) == sb and slots.users[sb] == 2  # sharing a held slot


def test_idle_slots_go_least_recently_used_first_and_empty_ones_before() -> None:
    slots, a = slots_with("abcd", max_loras=3)
    s = [slots.take(a[n]) for n in "ab"]
    assert slots.names == ["a", "b", None]
    for slot in s:
        slots.release(slot)
    assert slots.take(a["c"]) == 2  # the empty slot first
    slots.release(2)
    assert slots.take(a["d"]) == s[0]  # then a's, used longest ago
    assert slots.take(a["b"]) == s[1]  # b's still there: no reload
    assert slots.loads == 0


def test_a_slot_released_more_often_than_taken_is_an_error() -> None:
    slots, a = slots_with("a")
    slot = slots.take(a["a"])
    slots.release(slot)
    try:
        slots.release(slot)
    except ValueError as exc:
        assert "released more often than it was taken" in str(exc)
    else:
        raise AssertionError("a double release passed")
