"""jaxengine: a persistent-batch LLM sampler and inference engine in JAX with vLLM V1 semantics.

Core (no model needed):
  SamplingParams       per-request sampling parameters; StructuredOutputsParams,
                       RequestOutputKind (params.py; vLLM's path `jaxengine.sampling_params`)
  LogitsProcessor      your own JAX logits processor, row state in the batch (sample/custom.py)
  BatchConfig          capacities and static settings of a batch, validated once (config.py)
  InputBatch           the persistent batch, host side; HostSamplerOutput, LogprobsArrays (batch/)
  BatchState           the persistent batch, device side (sample/state.py)
  SamplingMetadata     sampler inputs derived per batch composition; refresh_metadata
                       (sample/metadata.py)
  sample_step          the pure jitted sampler step; SamplerOutput (sample/step.py)
  rejection_sample_step  speculative decoding's rejection sampler, pure and jitted;
                       RejectionOutput (sample/rejection.py); on the batch:
                       InputBatch.rejection_sample -> HostRejectionOutput
                       (batch/draft_verification.py)
  gather_logprobs      a token's logprob and rank plus the top-k, from any logits; LogprobsTensors
                       (sample/logprobs.py)

Engine (imported on first use; pulls in the model, tokenizer and transformers):
  LLM                  offline generate / chat (entrypoints/llm.py)
  LLMEngine            continuous batching step loop (engine/llm_engine.py)
  EngineConfig         the engine's options, validated once (engine_config.py)
  AsyncLLM             the engine in a background thread, outputs streamed to asyncio
                       (entrypoints/async_llm.py; `jaxengine serve` is its HTTP server)
  RequestOutput, CompletionOutput, Logprob   vLLM's output classes (outputs.py)
  LoRARequest          a request's LoRA adapter, a PEFT directory (lora/; `enable_lora=True`)
  EngineArgs, AsyncEngineArgs   vLLM's engine arguments, for `LLMEngine.from_engine_args` /
                       `AsyncLLM.from_engine_args` and `EngineArgs.add_cli_args`
                       (engine/arg_utils.py)

vLLM's module paths, for vLLM scripts with only `vllm` renamed: `jaxengine.sampling_params`,
`jaxengine.engine.arg_utils`, `jaxengine.utils` (`FlexibleArgumentParser`),
`jaxengine.distributed` (`cleanup_dist_env_and_memory`), `jaxengine.inputs` (`TextPrompt`,
`TokensPrompt`), `jaxengine.v1.engine.async_llm`.

Shape legend (every module, docstring and shape comment uses these letters):
  R  rows of the persistent batch (`max_num_reqs`)     N  live rows (`num_reqs`)
  V  vocabulary (`vocab_size`)                         S  cache positions per slot (`max_model_len`)
  T  tokens per row in one model call                  C  top-k candidates per row (static budget)
  B  rows of one model call (a bucket of R or a prefill group)
  P  draft positions per row in speculative decoding (`max_spec_len`)
  L  decoder layers   H  query heads   K  key/value heads   D  head dim
  E  hidden size      F  MLP intermediate size              W  block width of a blocked reduction
"""

import importlib

from jaxengine.batch import HostRejectionOutput, HostSamplerOutput, InputBatch, LogprobsArrays
from jaxengine.config import BatchConfig
from jaxengine.outputs import CompletionOutput, Logprob, RequestOutput
from jaxengine.params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from jaxengine.sample import (
  BatchState,
  LogitsProcessor,
  LogprobsTensors,
  RejectionOutput,
  SamplerOutput,
  SamplingMetadata,
  gather_logprobs,
  refresh_metadata,
  rejection_sample_step,
  sample_step,
)

_LAZY = {
  "LLM": "jaxengine.entrypoints.llm",
  "LLMEngine": "jaxengine.engine",
  "EngineConfig": "jaxengine.engine",
  "make_mesh": "jaxengine.parallel",
  "AsyncLLM": "jaxengine.entrypoints.async_llm",
  "EngineArgs": "jaxengine.engine.arg_utils",
  "AsyncEngineArgs": "jaxengine.engine.arg_utils",
  "LoRARequest": "jaxengine.lora",
}

__all__ = [
  "LLM",
  "AsyncEngineArgs",
  "AsyncLLM",
  "BatchConfig",
  "BatchState",
  "CompletionOutput",
  "EngineArgs",
  "EngineConfig",
  "HostRejectionOutput",
  "HostSamplerOutput",
  "InputBatch",
  "LLMEngine",
  "LoRARequest",
  "LogitsProcessor",
  "Logprob",
  "LogprobsArrays",
  "LogprobsTensors",
  "RejectionOutput",
  "RequestOutput",
  "RequestOutputKind",
  "SamplerOutput",
  "SamplingMetadata",
  "SamplingParams",
  "StructuredOutputsParams",
  "gather_logprobs",
  "make_mesh",
  "refresh_metadata",
  "rejection_sample_step",
  "sample_step",
]

__version__ = "0.1.0"


def __getattr__(name):
  if name in _LAZY:
    return getattr(importlib.import_module(_LAZY[name]), name)
  if name == "parallel":  # the submodule, as `je.parallel`
    return importlib.import_module("jaxengine.parallel")
  raise AttributeError(f"module 'jaxengine' has no attribute {name!r}")
