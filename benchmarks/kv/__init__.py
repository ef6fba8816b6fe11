"""KV transfer benchmarks: writes through kv_transfer's transports between two processes
on this machine, run through `python -m benchmarks.kv NAME`."""
