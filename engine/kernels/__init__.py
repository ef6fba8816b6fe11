"""Triton kernels for the paged KV cache (GPU; on CPU they run under TRITON_INTERPRET=1).

Every kernel loads the cache's dtype and computes in float32. Each launcher checks
shapes, strides and dtypes and raises ValueError naming the problem; the torch
reference in engine/attention/reference.py is the oracle each is tested against.
"""
