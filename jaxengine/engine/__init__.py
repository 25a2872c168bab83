"""The engine: a request's way in, the step loop, its way out (vLLM V1's `engine/`).

llm_engine.py         `LLMEngine`, which wires the others together and routes each request to
                      a core (one per data-parallel group)
engine_core.py        `EngineCore`: a scheduler and a model runner, one step, one lifecycle
                      (`_update_from_output` applies a step's tokens, `_finish` the one finish path)
input_processor.py    prompts and `SamplingParams` -> validated `Request`s
model_loader.py       a path, hub id or built model loaded for an engine, with its tokenizer
generation_config.py  a checkpoint's sampling defaults (`generation_config.json`)
arg_utils.py          vLLM's `EngineArgs` / `AsyncEngineArgs` (`LLMEngine.from_engine_args`)
engine_flags.py       the engine's command-line flags: one table from flag to `EngineConfig`
                      field (`jaxengine generate`, `serve`, `eval`, `EngineArgs.add_cli_args`)
structured.py         structured outputs: llguidance grammars, matchers and the token bitmask
output_processor.py   tokens -> logprob dicts, text and stop rules
pause.py              `pause_generation` / `resume_generation` (keep, wait, abort) and the
                      weight version stamped on each token (`LLMEngine`'s mixin)

The rest of the house, in the order its dependencies point: `jaxengine/core/` (requests, pages
and the scheduler, host only), `jaxengine/spec_decode/` (drafts), `jaxengine/worker/` (the model
runner and its jitted steps), then this package. `jaxengine/engine_config.py` holds the options
all of them read.
"""

from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.engine.output_processor import find_stop_string
from jaxengine.engine_config import EngineConfig
from jaxengine.worker.model_runner import ModelRunner

__all__ = ["EngineConfig", "LLMEngine", "ModelRunner", "find_stop_string"]
