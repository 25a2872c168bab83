"""jaxengine inside the frameworks its users train and evaluate in (each module imports its
framework; install its extra).

lm_eval.py           `JaxEngineLM`: jaxengine as lm-evaluation-harness's `jaxengine` model
tunix.py             `JaxEngineRollout`: jaxengine as a Tunix RL rollout engine
tunix_weights.py     Tunix's Llama 3 / Qwen2 / Qwen3 configs and weights as `models.Llama`'s
"""
