"""Speculative decoding: cheap draft tokens, verified by the model k + 1 at a time.

config.py holds the settings; ngram.py and draft_model.py propose; speculator.py picks
each step's drafts and judges them (greedy match, or rejection sampling in the sampler).
"""
