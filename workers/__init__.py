"""What both worker roles (decode_worker/, prefill_worker/) share: the event loop and its
failure handling (loop.py), the watchdogs, the launcher's control channel, and the
WorkerConfig a launcher starts a worker with."""
