"""Speculative decoding on the host: n-gram and suffix drafts, and when to verify them (vLLM V1's
`spec_decode/`).

The device side (drafts as query tokens, the rejection sampler) is `worker/verify_step.py`.

config.py             `SpeculativeConfig`: the `speculative_config` dict, validated
ngram_proposer.py     n-gram (prompt lookup) drafts, the acceptance stats, the cost model
policy.py             `SpeculativePolicy`: which rows get drafts this step
speculation.py        `Speculation`: drafts before a step, accepted drafts after it
suffix_tree.py        `SuffixTree`: counts of bounded-length substrings, greedy drafts from them
suffix_proposer.py    suffix decoding: drafts from the request, its prompt's samples, past outputs
"""
