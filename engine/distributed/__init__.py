"""Tensor parallelism: one process per rank, Megatron-style sharding, lockstep steps.

sharding.py says which slice of every weight and which KV heads a rank holds; group.py
is the ranks' collectives (gloo on CPU, NCCL on CUDA, each with a timeout); lora_sync.py
sends a LoRA adapter's weights to the followers; the driver
(rank 0, driver.py) runs the scheduler and sampler and starts one follower process per
other rank (follower.py), which runs each step's forward on the inputs the driver
broadcasts (step_codec.py), once per step; rank_model.py is what every rank builds
alike. Rank caches on CPU live in files (shared_cache.py, named by shm_files.py) so
the driver can reach every rank's KV for transfers.
"""
