"""vLLM's module path `vllm.sampling_params`: `SamplingParams`, `StructuredOutputsParams` and
`RequestOutputKind` (defined in `jaxengine.params`)."""

from jaxengine.params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = ["RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]
