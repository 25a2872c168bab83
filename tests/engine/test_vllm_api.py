"""vLLM's API shapes a vLLM script calls, with `vllm` renamed `jaxengine`: `EngineArgs` from
`FlexibleArgumentParser` + `add_cli_args`, `LLMEngine.from_engine_args` stepped by hand,
`AsyncLLM.from_engine_args` streaming per `SamplingParams.output_kind`,
`LLM.get_default_sampling_params`, and vLLM's module paths. One tiny Hugging Face checkpoint
(no tokenizer: token-id prompts, as `jaxengine.inputs.TokensPrompt`) with a
`generation_config.json`."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json

import hf_checkpoints
import pytest

import jaxengine as je
from jaxengine.distributed import cleanup_dist_env_and_memory
from jaxengine.engine.arg_utils import AsyncEngineArgs, EngineArgs
from jaxengine.inputs import TokensPrompt
from jaxengine.sampling_params import RequestOutputKind, SamplingParams
from jaxengine.utils import FlexibleArgumentParser
from jaxengine.v1.engine.async_llm import AsyncLLM

PROMPT = [5, 6, 7]
GENERATION_CONFIG = {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 7, "do_sample": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  directory = tmp_path_factory.mktemp("vllm_api")
  config = hf_checkpoints.hf_config("LlamaForCausalLM")
  tensors = hf_checkpoints.random_tensors(hf_checkpoints.config_dict(config))
  hf_checkpoints.write_checkpoint(directory, config, tensors)
  (directory / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
  return str(directory)


def _parser() -> FlexibleArgumentParser:
  """vLLM's generate.py's command line: engine arguments in a group, sampling flags beside."""
  parser = FlexibleArgumentParser()
  group = parser.add_argument_group("Engine arguments")
  EngineArgs.add_cli_args(group)
  group.set_defaults(model="unused-default")
  parser.add_argument("--max-tokens", type=int)
  return parser


def test_engine_args_from_the_command_line_build_and_step_an_engine(checkpoint):
  """`EngineArgs.from_cli_args(parser.parse_args([...]))` -> `LLMEngine.from_engine_args`,
  stepped as vLLM's llm_engine_example.py does; vLLM's names and underscore spellings parse;
  `vars(args)` are `LLM` keywords (vLLM's generate.py calls `LLM(**args)`)."""
  argv = ["--model", checkpoint, "--max_num_seqs", "2", "--max-model-len=32", "--seed", "3"]
  args = _parser().parse_args([*argv, "--enforce-eager", "--max-tokens", "4"])
  engine_args = EngineArgs.from_cli_args(args)
  assert (engine_args.model, engine_args.max_num_seqs, engine_args.seed) == (checkpoint, 2, 3)
  engine = je.LLMEngine.from_engine_args(engine_args)
  assert (engine.config.max_num_reqs, engine.config.max_model_len, engine.config.seed) == (2, 32, 3)
  greedy = SamplingParams(temperature=0, max_tokens=4)
  engine.add_request("0", TokensPrompt(prompt_token_ids=PROMPT), greedy)  # vllm.inputs' dict
  finished = []
  while engine.has_unfinished_requests():
    finished += [o for o in engine.step() if o.finished]
  assert [o.request_id for o in finished] == ["0"]
  assert len(finished[0].outputs[0].token_ids) == 4
  # Returned finished, the request is forgotten (vLLM's): its id is free again, nothing is
  # left for pop_finished, and a loop that numbers its requests from 0 again runs.
  assert engine.pop_finished() == []
  engine.add_request("0", TokensPrompt(prompt_token_ids=PROMPT), greedy)
  while engine.has_unfinished_requests():
    finished += [o for o in engine.step() if o.finished]
  assert [o.request_id for o in finished] == ["0", "0"]
  assert finished[1].outputs[0].token_ids == finished[0].outputs[0].token_ids
  options = vars(args)
  options.pop("max_tokens")
  llm = je.LLM(**options)
  assert llm.config == engine.config
  (again,) = llm.generate(PROMPT, greedy, use_tqdm=False)
  assert again.outputs[0].token_ids == finished[0].outputs[0].token_ids
  as_dict = dataclasses.asdict(EngineArgs(model=checkpoint, max_num_seqs=2, max_model_len=32))
  assert je.LLM(**as_dict).config.max_num_reqs == 2  # vLLM's LLM(**asdict(engine_args))


def test_engine_args_refuse_what_jaxengine_has_not(capsys):
  with pytest.raises(TypeError, match="'swap_space' is not an engine argument jaxengine has"):
    EngineArgs(swap_space=4)
  with pytest.raises(TypeError, match=r"'max_num_reqs' .* it is 'max_num_seqs' here"):
    AsyncEngineArgs(max_num_reqs=4)
  with pytest.raises(ValueError, match="max_num_reqs must be a positive int, got 0"):
    EngineArgs(max_num_seqs=0).create_engine_config()
  with pytest.raises(SystemExit):
    _parser().parse_args(["--swap-space", "4"])
  assert "an engine argument jaxengine has" in capsys.readouterr().err


def test_get_default_sampling_params_reads_generation_config_and_is_assignable(
  checkpoint, tmp_path, monkeypatch
):
  """vLLM's generate.py: `sp = llm.get_default_sampling_params()`, then assigns to it;
  simple_profiling.py: `start_profile` / `stop_profile` around a generate write a trace under
  `VLLM_TORCH_PROFILER_DIR`."""
  llm = je.LLM(checkpoint, max_num_seqs=2, max_model_len=32)
  params = llm.get_default_sampling_params()
  assert (params.temperature, params.top_p, params.max_tokens) == (0.6, 0.9, 7)
  params.max_tokens, params.temperature = 3, 0.0
  monkeypatch.delenv("JAXENGINE_PROFILER_DIR", raising=False)
  monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
  with pytest.raises(RuntimeError, match="set JAXENGINE_PROFILER_DIR"):
    llm.start_profile()
  monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))
  llm.start_profile()
  (out,) = llm.generate(PROMPT, params, use_tqdm=False)
  llm.stop_profile()
  assert list(tmp_path.glob("plugins/profile/*/*.xplane.pb")), "no trace written"
  assert len(out.outputs[0].token_ids) == 3
  assert llm.get_default_sampling_params().max_tokens == 7, "a new object each call"
  del llm
  cleanup_dist_env_and_memory()  # vLLM scripts call it between engines


def test_async_llm_from_engine_args_honours_output_kind(checkpoint):
  """vLLM's async_llm_streaming.py: `AsyncLLM.from_engine_args(AsyncEngineArgs(...))` and
  `SamplingParams(output_kind=RequestOutputKind.DELTA)` stream only the new tokens; the
  default CUMULATIVE streams everything so far; FINAL_ONLY yields once."""
  engine = AsyncLLM.from_engine_args(
    AsyncEngineArgs(model=checkpoint, max_num_seqs=2, max_model_len=32, enforce_eager=True)
  )

  async def collect(kind):
    params = SamplingParams(temperature=0.8, seed=42, max_tokens=6, output_kind=kind)
    return [o async for o in engine.generate(PROMPT, params, request_id=f"r-{kind.name}")]

  async def main():
    return [await collect(kind) for kind in RequestOutputKind]

  try:
    cumulative, delta, final = asyncio.run(main())
  finally:
    engine.shutdown()
  tokens = final[-1].outputs[0].token_ids
  assert len(final) == 1 and final[0].finished and len(tokens) == 6
  assert [t for o in delta for c in o.outputs for t in c.token_ids] == tokens
  assert cumulative[-1].outputs[0].token_ids == tokens
  for before, after in itertools.pairwise(cumulative):  # each holds the one before
    assert after.outputs[0].token_ids[: len(before.outputs[0].token_ids)] == (
      before.outputs[0].token_ids
    )
