"""A tensor-parallel follower rank: `python -m engine.distributed.follower`, started by
the driver (driver.py), which writes its orders on stdin.

It holds its shard of the model and its rank's KV cache, and runs each step's forward
on the inputs the driver broadcasts; it never schedules or samples. It exits when
told to stop, when its stdin closes (the driver is gone), or when a step fails (a
collective timed out or the forward raised): the driver's next collective then
fails and the worker goes down loudly.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

import torch

from engine.config import EngineConfig
from engine.distributed import lora_sync, shared_cache
from engine.distributed.driver import DRIVER_PID_ENV
from engine.distributed.group import TorchGroup
from engine.distributed.sharding import Shard
from engine.distributed.step_codec import StepCodec

logger = logging.getLogger("engine.distributed.follower")


def serve(stdin) -> None:
    start = json.loads(stdin.readline())
    config = EngineConfig(**start["config"])
    rank, size = start["rank"], config.tensor_parallel_size
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    store = TorchGroup.client_store(start["port"], size)
    store.set(f"started{rank}", "1")
    try:
        _serve(stdin, config, rank, store)
    except Exception as exc:
        try:  # the driver names the cause when it sees this rank gone (driver.check_alive)
            store.set(f"failed{rank}", f"{type(exc).__name__}: {exc}"[:2000])
        except Exception:
            pass
        raise


def _serve(stdin, config: EngineConfig, rank: int, store) -> None:
    from engine.attention.kv_quant import cache_dtype
    from engine.distributed.rank_model import build_rank_model, step_codec
    from engine.lora.layers import load_into_slot, wrap_projections
    from engine.model.loader import TORCH_DTYPES
    from engine.runner import ModelRunner, allocate_kv_cache, kv_cache_shape

    group = TorchGroup(rank, config.tensor_parallel_size, 0, config.distributed_timeout_s,
                       torch.device(config.device), store)
    model, model_config, backend, model_len = build_rank_model(config, rank, group)
    shard: Shard = model.shard
    cache = json.loads(stdin.readline())
    num_blocks = cache["num_blocks"]
    dtype = cache_dtype(config.kv_cache_dtype, TORCH_DTYPES[config.dtype])
    if cache["cache"] is not None:
        shape = kv_cache_shape(model_config, num_blocks, config.block_size, shard.num_kv_heads)
        kv_cache = shared_cache.attach(cache["cache"], shape, dtype)
    else:
        kv_cache = allocate_kv_cache(model_config, num_blocks, config.block_size, dtype, config.device,
                                     num_kv_heads=shard.num_kv_heads)
    wrapped = {}
    if config.enable_lora:  # the driver sends each adapter's weights as it takes a slot (lora_sync.py)
        wrapped = wrap_projections(model, model_config, config.max_loras, config.max_lora_rank,
                                   TORCH_DTYPES[config.dtype], config.device, shard)
    runner = ModelRunner(model, kv_cache, config.block_size, None, backend, config.device)
    codec: StepCodec = step_codec(config, model_len)
    buffer = codec.buffer()
    group.store.set(f"ready{rank}", "1")
    for line in stdin:
        order = line.strip()
        if order == "stop":
            break
        if order == "ping":  # the driver's heartbeat
            group.all_reduce_(torch.zeros(1))
            continue
        if order.startswith("{") and wrapped:  # a LoRA adapter into a slot
            record = json.loads(order)
            flat = group.broadcast_(lora_sync.buffer(record["keys"], group.device))
            load_into_slot(wrapped, record["lora"], lora_sync.unpack(record["keys"], flat))
            continue
        if order != "step":
            raise ValueError(f"unknown order {order!r} from the driver")
        group.broadcast_(buffer)
        runner.forward(codec.decode(buffer))
    group.close()


def _exit_with_driver(driver_pid: int) -> None:
    """A follower still starting (joining the store, loading weights) reads no orders, so
    it would not see its stdin close: it watches its parent instead."""
    while os.getppid() == driver_pid:
        time.sleep(0.5)
    logger.error("tensor-parallel follower: its driver (pid %d) is gone; exiting", driver_pid)
    os._exit(1)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    # The driver's pid from the driver itself: one that died before this line ran
    # would leave us adopted, and our parent would look alive.
    driver = int(os.environ.get(DRIVER_PID_ENV, os.getppid()))
    threading.Thread(target=_exit_with_driver, args=(driver,), daemon=True, name="driver-watch").start()
    try:
        serve(sys.stdin)
    except Exception:
        logger.exception("tensor-parallel follower failed")
        sys.exit(1)


if __name__ == "__main__":
    main()
