"""The engine, split by job as vLLM's V1 engine is.

requests.py          host records: a `Request` and its `Completion`s
input_processor.py   prompts and `SamplingParams` -> validated `Request`s
scheduler.py         which completions run (first come, first served, within the batch's rows)
runner.py            `ModelRunner`: weights, KV cache, persistent batch, jitted prefill/decode
multi_step.py        k decode-and-sample steps in one device loop, rows stopping on the device
shared_prefill.py    one prefill for the n samples of a request (KV copied between slots)
speculative.py       n-gram speculative decoding: the config, the host proposer, the stats
verify.py            the verify step: the model over k + 1 positions, then rejection_sample
output_processor.py  tokens -> logprob dicts, text and stop rules
core.py              `LLMEngine`, which wires them together
"""

from jaxengine.engine.core import LLMEngine
from jaxengine.engine.output_processor import find_stop_string
from jaxengine.engine.runner import ModelRunner

__all__ = ["LLMEngine", "ModelRunner", "find_stop_string"]
