"""Randomised schedule fuzzers (harness.py)."""

import os

import torch

if not torch.cuda.is_available():  # before any @triton.jit is defined: the engine's kernels run on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")
