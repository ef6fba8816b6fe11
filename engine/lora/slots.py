"""Which adapters hold the model's max_loras slots, and which are kept read in memory.

A running request holds its adapter's slot (a reference); a slot no running request
holds may be given to another adapter, least recently used first. Adapters read from
disk are kept in host memory, up to max_cpu_loras, least recently used dropped first.

Admission (Scheduler): a request whose adapter has no slot, when every slot is held,
waits. Once one has waited, no request of another adapter is admitted in that step
(base-model requests still are), so the held slots drain and it gets one: requests of
a busy adapter cannot starve another's.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.lora.adapter import LoRAAdapter, load_adapter
from engine.lora.layers import LoRALinear, load_into_slot
from engine.lora.request import LoRARequest
from engine.model.config import ModelConfig
from engine.request import Request


class LoRASlots:
    def __init__(self, wrapped: dict[tuple[int, str], LoRALinear], cfg: ModelConfig | None, max_loras: int,
                 max_lora_rank: int, max_cpu_loras: int) -> None:
        self.wrapped, self.cfg = wrapped, cfg
        self.max_lora_rank, self.max_cpu_loras = max_lora_rank, max_cpu_loras
        self.names: list[str | None] = [None] * max_loras  # the adapter in each slot
        self.users = [0] * max_loras  # running requests holding each slot
        self._last_used = [0] * max_loras
        self._clock = 0
        self.loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()  # read adapters, LRU first
        self._waiting: str | None = None  # an adapter a request waits for a slot for, this step
        self.loads = 0  # adapters read from disk

    @classmethod
    def disabled(cls) -> LoRASlots:
        """An engine without enable_lora: no slots (its requests never name an adapter)."""
        return cls({}, None, 0, 0, 0)

    # --- the scheduler's verbs -----------------------------------------------------

    def waits(self, request: Request) -> bool:
        """A queued request that may not start running this step for want of a slot."""
        return request.lora is not None and not self.admits(request.lora.adapter)

    def start(self, request: Request) -> None:
        if request.lora is not None:
            request.lora.slot = self.take(request.lora.adapter)

    def stop(self, request: Request) -> None:
        """It stopped running (finished, preempted): its slot reference goes."""
        if request.lora is not None and request.lora.slot >= 0:
            self.release(request.lora.slot)
            request.lora.slot = -1

    def adapter(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter, read (and checked: ValueError naming the problem) if not in memory."""
        adapter = self.loaded.get(lora.lora_name)
        if adapter is not None and adapter.path == lora.lora_path:
            self.loaded.move_to_end(lora.lora_name)
            return adapter
        if self.cfg is None:
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: this engine was started without enable_lora")
        adapter = load_adapter(lora.lora_name, lora.lora_path, self.cfg, self.max_lora_rank)
        self.loads += 1
        self.loaded[lora.lora_name] = adapter
        self.loaded.move_to_end(lora.lora_name)
        while len(self.loaded) > self.max_cpu_loras:
            self.loaded.popitem(last=False)
        return adapter

    def begin_step(self) -> None:
        self._waiting = None

    def admits(self, lora: LoRARequest) -> bool:
        """Whether a request of `lora` may start running now: its adapter holds a slot, or
        one is idle, and no other adapter waits first this step (module docstring)."""
        if self._waiting is not None and self._waiting != lora.lora_name:
            return False
        if self._slot_of(lora) is None and all(self.users):
            self._waiting = lora.lora_name
            return False
        return True

    def take(self, lora: LoRARequest) -> int:
        """A slot holding `lora` for a request that starts running (one more reference;
        admits() said it may), its adapter loaded into it if it was not there."""
        slot = self._slot_of(lora)
        if slot is None:
            idle = [s for s in range(len(self.names)) if self.users[s] == 0]
            if not idle:
                raise ValueError(f"no LoRA slot is idle for adapter {lora.lora_name!r}")
            slot = min(idle, key=lambda s: (self.names[s] is not None, self._last_used[s]))
            load_into_slot(self.wrapped, slot, self.adapter(lora))
            self.names[slot] = lora.lora_name
        self.users[slot] += 1
        self._clock += 1
        self._last_used[slot] = self._clock
        return slot

    def release(self, slot: int) -> None:
        """A request that held `slot` stopped running (finished, preempted)."""
        if self.users[slot] <= 0:
            raise ValueError(f"LoRA slot {slot} released more often than it was taken")
        self.users[slot] -= 1

    def _slot_of(self, lora: LoRARequest) -> int | None:
        for slot, name in enumerate(self.names):
            if name == lora.lora_name:
                adapter = self.loaded.get(name)
                if adapter is not None and adapter.path != lora.lora_path:
                    return None  # the name now means another directory: reload it
                return slot
        return None
