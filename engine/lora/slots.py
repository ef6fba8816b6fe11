"""Which adapters hold the model's max_loras slots, and which are kept read in memory.

An adapter is read once, when a request first names it (again when a request names
other files under its name, or a digest of them that the read's is not), and the
request keeps that read (LoRAUse.adapter) until it ends: nothing is read from disk
inside a step, and a name pointed at another directory meanwhile (or its files
changed) is a new adapter beside the old one, with its own prefix-cache root, while
requests of the old one finish with the old weights. Host memory keeps up to
max_cpu_loras reads for requests to come, least recently used dropped first.

A running request holds its adapter's slot (a reference); a slot no running request
holds may be given to another adapter, least recently used first. Admission
(Scheduler): a request whose adapter has no slot, when every slot is held, waits. Once
one has waited, no request of another adapter is admitted in that step (base-model
requests still are), so the held slots drain and it gets one: requests of a busy
adapter cannot starve another's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from engine.lora.adapter import LoRAAdapter, load_adapter
from engine.lora.files import AdapterError
from engine.lora.layers import LoRALinear, load_into_slot
from engine.lora.request import LoRARequest
from engine.model.config import ModelConfig
from engine.request import Request


class LoRASlots:
    def __init__(self, wrapped: dict[tuple[int, str], LoRALinear], cfg: ModelConfig | None, max_loras: int,
                 max_lora_rank: int, max_cpu_loras: int) -> None:
        self.wrapped, self.cfg = wrapped, cfg
        self.max_lora_rank, self.max_cpu_loras = max_lora_rank, max_cpu_loras
        self.held: list[LoRAAdapter | None] = [None] * max_loras  # the adapter in each slot
        self.users = [0] * max_loras  # running requests holding each slot
        self._last_used = [0] * max_loras
        self._clock = 0
        self.loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()  # reads kept for requests to come, LRU first
        self._waiting: LoRAAdapter | None = None  # an adapter a request waits for a slot for, this step
        self.loads = 0  # adapters read from disk
        # Tensor parallelism: the other ranks get an adapter the scheduler puts in a slot
        # (TPDriver.load_lora), before the step that runs it.
        self.on_load: Callable[[int, LoRAAdapter], None] | None = None

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
        """It stopped running (finished, preempted, prefilled): its slot reference goes."""
        if request.lora is not None and request.lora.slot >= 0:
            self.release(request.lora.slot)
            request.lora.slot = -1

    # --- adapters and slots ----------------------------------------------------------

    def adapter(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter `lora` names, read (and checked: ValueError naming the problem)
        unless a read of the same directory is kept."""
        adapter = self.loaded.get(lora.lora_name)
        if adapter is not None and adapter.path == lora.lora_path and lora.digest in (None, adapter.digest):
            self.loaded.move_to_end(lora.lora_name)
            return adapter
        if self.cfg is None:
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: this engine was started without enable_lora")
        try:
            adapter = load_adapter(lora.lora_name, lora.lora_path, self.cfg, self.max_lora_rank)
        except ValueError as exc:
            raise AdapterError(str(exc)) from None
        self.loads += 1
        if lora.digest not in (None, adapter.digest):  # another process would run it with other weights
            raise AdapterError(f"LoRA adapter {lora.lora_name!r}: its files at {lora.lora_path} changed since the "
                             "server loaded them; load it again (POST /v1/load_lora_adapter with load_inplace)")
        self.loaded[lora.lora_name] = adapter
        self.loaded.move_to_end(lora.lora_name)
        while len(self.loaded) > self.max_cpu_loras:
            self.loaded.popitem(last=False)
        return adapter

    def begin_step(self) -> None:
        self._waiting = None

    def admits(self, adapter: LoRAAdapter) -> bool:
        """Whether a request of `adapter` may start running now: it holds a slot, or one
        is idle, and no other adapter waits first this step (module docstring)."""
        if self._waiting is not None and self._waiting is not adapter:
            return False
        if self._slot_of(adapter) is None and all(self.users):
            self._waiting = adapter
            return False
        return True

    def take(self, adapter: LoRAAdapter) -> int:
        """A slot holding `adapter` for a request that starts running (one more
        reference; admits() said it may), the adapter written into it if not there."""
        slot = self._slot_of(adapter)
        if slot is None:
            idle = [s for s in range(len(self.held)) if self.users[s] == 0]
            if not idle:
                raise ValueError(f"no LoRA slot is idle for adapter {adapter.name!r}")
            slot = min(idle, key=lambda s: (self.held[s] is not None, self._last_used[s]))
            load_into_slot(self.wrapped, slot, adapter.weights)
            if self.on_load is not None:
                self.on_load(slot, adapter)
            self.held[slot] = adapter
        self.users[slot] += 1
        self._clock += 1
        self._last_used[slot] = self._clock
        return slot

    def release(self, slot: int) -> None:
        """A request that held `slot` stopped running (finished, preempted)."""
        if self.users[slot] <= 0:
            raise ValueError(f"LoRA slot {slot} released more often than it was taken")
        self.users[slot] -= 1

    def _slot_of(self, adapter: LoRAAdapter) -> int | None:
        return next((slot for slot, held in enumerate(self.held) if held is adapter), None)
