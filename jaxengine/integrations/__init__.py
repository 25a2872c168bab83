"""Plug-ins for the frameworks jaxengine's users train and evaluate in (each an optional extra).

tunix.py             `JaxEngineRollout`: jaxengine as a Tunix RL rollout engine
tunix_weights.py     Tunix's Llama 3 / Qwen2 / Qwen3 configs and weights as `models.Llama`'s
"""
