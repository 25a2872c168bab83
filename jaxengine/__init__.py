"""jaxengine: a persistent-batch LLM sampler and inference engine in JAX with vLLM V1 semantics.

Public names:
  SamplingParams       per-request sampling parameters (params.py)
  InputBatch           the persistent batch, host side (batch.py)
  BatchState           the persistent batch, device side (state.py)
  SamplingMetadata     derived per-composition sampler inputs; refresh_metadata builds it (metadata.py)
  sample_step          the pure jitted sampler step; SamplerOutput, LogprobsTensors its output (sampler.py)
"""

from jaxengine.batch import InputBatch
from jaxengine.metadata import SamplingMetadata, refresh_metadata
from jaxengine.params import SamplingParams
from jaxengine.sampler import LogprobsTensors, SamplerOutput, gather_logprobs, sample_step
from jaxengine.state import BatchState

__all__ = [
    "BatchState",
    "InputBatch",
    "LogprobsTensors",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingParams",
    "gather_logprobs",
    "refresh_metadata",
    "sample_step",
]

__version__ = "0.1.0"
