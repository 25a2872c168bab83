"""Speculative decoding on the host: n-gram drafts and when to verify them (vLLM V1's `spec_decode/`).

The device side (drafts as query tokens, the rejection sampler) is `worker/verify_step.py`.

config.py             `SpeculativeConfig`: the `speculative_config` dict, validated
ngram_proposer.py     n-gram (prompt lookup) drafts, the acceptance stats, the cost model
policy.py             `SpeculativePolicy`: which rows get drafts this step
speculation.py        `Speculation`: drafts before a step, accepted drafts after it
"""
