"""Speculative decoding: cheap draft tokens, verified by the model k + 1 at a time.

config.py holds the settings; ngram.py and draft_model.py propose (draft_check.py
checks a draft model before anything loads); speculator.py picks each step's drafts
and counts what came of them; metrics.py names those counters. The sampler judges the
drafts (engine/sampling/sampler.py), the scheduler places them (Scheduler._add_drafts).
"""
