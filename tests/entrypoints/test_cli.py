"""The `jaxengine` command: on the real default model, and on a tiny model for the chat loop."""

from __future__ import annotations

import io
import subprocess
import sys

import hf_checkpoints
import jax.numpy as jnp
import pytest
from byte_tokenizer import chatml_byte_tokenizer
from step_shapes import one_shape

import jaxengine.cli.main as cli
import jaxengine.entrypoints.llm as llm_module
from jaxengine.engine import model_loader
from jaxengine.engine.engine_flags import engine_options
from jaxengine.engine_config import EngineConfig
from jaxengine.models import gguf_loader
from jaxengine.testing import tiny_llama


@pytest.fixture
def one_shape_llm(monkeypatch):
  """Makes `cli.main`'s `LLM` run each step in one shape (`one_shape`): the tests of the real
  model check what the command prints, not bucket choice; with `ONE_SHAPE` (2 rows, 8 tokens a
  step) SmolLM2's model step compiles once for them all."""
  real_llm = llm_module.LLM
  monkeypatch.setattr(
    llm_module, "LLM", lambda *args, **kwargs: one_shape(real_llm(*args, **kwargs))
  )


#: The sizes of the SmolLM2 engines that generate (one step shape: `one_shape_llm`).
ONE_SHAPE = ["--max-model-len", "64", "--max-num-reqs", "2", "--max-num-batched-tokens", "8"]


def test_generate_streams_a_continuation_naming_paris(capsys, one_shape_llm):
  argv = ["generate", "The capital of France is", "--max-tokens", "8", *ONE_SHAPE]
  assert cli.main(argv) == 0
  out = capsys.readouterr().out
  assert out.startswith("The capital of France is Paris")


def test_generate_several_prompts_with_logprobs(capsys, one_shape_llm):
  prompts = ["The capital of France is", "Water boils at"]
  sampling = ["--temperature", "0.7", "--top-p", "0.9", "--seed", "1", "--logprobs", "2"]
  assert cli.main(["generate", *prompts, "--max-tokens", "4", *sampling, *ONE_SHAPE]) == 0
  out = capsys.readouterr().out
  assert out.count("--- [") == 2 and out.count("logprobs of [") == 2


def test_refused_request_and_bad_flag_exit_with_status_2(capsys):
  assert cli.main(["generate", "word " * 100, "--max-model-len", "32", "--max-num-reqs", "1"]) == 2
  assert "max_model_len" in capsys.readouterr().err
  assert cli.main(["generate", "hi", "--top-p", "1.5"]) == 2
  assert "top_p" in capsys.readouterr().err


def test_python_dash_m_help_is_fast_and_lists_sampling_flags():
  result = subprocess.run(
    [sys.executable, "-m", "jaxengine", "generate", "--help"],
    capture_output=True,
    text=True,
    check=True,
    timeout=60,
  )
  for flag in (
    "--temperature",
    "--top-p",
    "--top-k",
    "--min-p",
    "--max-tokens",
    "--seed",
    "--logprobs",
    "--n",
  ):
    assert flag in result.stdout


# --------------------------------------------------------------------------- tiny model, no load


@pytest.fixture
def tiny_llm(monkeypatch):
  """Makes `cli.main` build its `LLM` on a random tiny model, each step in one shape (the
  chats' engines in `TINY_CHAT`'s sizes); yields the `--model` values seen."""
  tokenizer = chatml_byte_tokenizer()
  model, _ = tiny_llama(vocab_size=tokenizer.vocab_size)
  real_llm = llm_module.LLM
  models_asked = []

  def make_llm(model_path, **kwargs):
    models_asked.append(model_path)
    return one_shape(real_llm(model, tokenizer=tokenizer, **kwargs))

  monkeypatch.setattr(llm_module, "LLM", make_llm)
  return models_asked


#: The sizes of the tiny chats' engines: one step shape (2 rows, 16 tokens) for them all.
TINY_CHAT = ["--max-model-len", "96", "--max-num-reqs", "2", "--max-num-batched-tokens", "16"]


def _no_model_load(monkeypatch):
  def refuse(*args, **kwargs):
    raise AssertionError("the model was loaded before the flags were checked")

  monkeypatch.setattr(llm_module, "LLM", refuse)


def test_read_message_skips_thousands_of_blank_lines(monkeypatch):
  monkeypatch.setattr(sys, "stdin", io.StringIO("\n" * 3000 + "  \nhello\n"))
  assert cli._read_message() == "hello"
  assert cli._read_message() is None  # end of input


class _Terminal(io.StringIO):
  """Input that says it is a terminal."""

  def isatty(self) -> bool:
    return True


def test_interactive_chat_reads_past_blank_lines(monkeypatch, capsys, tiny_llm):
  monkeypatch.setattr(sys, "stdin", _Terminal("\n" * 3000 + "hi\n/quit\nnever read\n"))
  assert cli.main(["chat", "--max-tokens", "3", "--ignore-eos", *TINY_CHAT]) == 0
  assert capsys.readouterr().out.count(">>> ") == 3002


def test_piped_chat_prints_no_prompts_and_labels_samples_by_index(monkeypatch, capsys, tiny_llm):
  monkeypatch.setattr(sys, "stdin", io.StringIO("Name a river.\n"))
  argv = ["chat", "--n", "2", "--temperature", "1", "--max-tokens", "3", "--ignore-eos"]
  assert cli.main([*argv, *TINY_CHAT]) == 0
  out = capsys.readouterr().out
  assert ">>>" not in out and "im_start" not in out
  assert "--- sample 1 of 2\n" in out and "--- sample 2 of 2\n" in out


@pytest.mark.parametrize(
  "flags", [["--top-k", "5"], ["--top-p", "0.9"], ["--min-p", "0.1"], ["--seed", "1"]]
)
def test_sampling_only_flags_without_temperature_are_refused_before_loading(
  monkeypatch, capsys, flags
):
  _no_model_load(monkeypatch)
  assert cli.main(["generate", "Hello", *flags]) == 2
  assert capsys.readouterr().err == (
    f"jaxengine: {flags[0]} has no effect with greedy sampling (--temperature defaults to 0): "
    "pass --temperature\n"
  )
  args = cli.build_parser().parse_args(["generate", "Hello", *flags, "--temperature", "0.5"])
  assert cli._sampling_params(args).temperature == 0.5
  assert cli._sampling_params(cli.build_parser().parse_args(["generate", "Hi"])).is_greedy


def test_json_schema_that_is_neither_a_file_nor_json_is_refused_before_loading(monkeypatch, capsys):
  _no_model_load(monkeypatch)
  assert cli.main(["generate", "x", "--json-schema", "schema.json"]) == 2
  assert "no file 'schema.json', and not valid JSON: " in capsys.readouterr().err
  assert cli.main(["generate", "x", "--json-schema", '{"type": "object"']) == 2
  assert "--json-schema is not valid JSON" in capsys.readouterr().err


def test_vllm_engine_flags_enforce_eager_trust_remote_code_and_float16():
  args = cli.build_parser().parse_args(
    ["generate", "Hi", "--enforce-eager", "--trust-remote-code", "--dtype", "float16"]
  )
  options = engine_options(args)
  assert options["enforce_eager"] is True and options["trust_remote_code"] is True
  config = EngineConfig(**options)
  assert config.dtype == jnp.float16 and config.enforce_eager and config.trust_remote_code
  defaults = engine_options(cli.build_parser().parse_args(["generate", "Hi"]))
  assert not defaults["enforce_eager"] and not defaults["trust_remote_code"]


@pytest.mark.parametrize(
  "flags, named",
  [
    (["--json-schema", '{"type": "nonsense"}'], "structured_outputs.json is invalid"),
    (["--regex", "("], "structured_outputs.regex is invalid"),
  ],
)
def test_constraints_llguidance_refuses_are_refused_before_loading(
  monkeypatch, capsys, flags, named
):
  _no_model_load(monkeypatch)
  assert cli.main(["generate", "x", *flags]) == 2
  assert named in capsys.readouterr().err


def _no_weights_load(monkeypatch):
  def refuse(*args, **kwargs):
    raise AssertionError("the weights were loaded before max_model_len was checked")

  monkeypatch.setattr(model_loader, "load_resolved", refuse)  # LLM's one way to read weights


def test_max_model_len_past_the_config_is_refused_before_the_weights_load(
  monkeypatch, capsys, tmp_path
):
  """The limit comes from the GGUF metadata or config.json, read before any tensor."""
  _no_weights_load(monkeypatch)
  limit = gguf_loader.read_config(
    gguf_loader.open_gguf(gguf_loader.default_model_path())
  ).max_position_embeddings
  assert cli.main(["generate", "x", "--max-model-len", str(limit + 1)]) == 2
  err = capsys.readouterr().err
  assert f"max_model_len={limit + 1} exceeds" in err and f"max_position_embeddings={limit}" in err
  config = hf_checkpoints.hf_config("LlamaForCausalLM", max_position_embeddings=64)
  hf_checkpoints.write_checkpoint(tmp_path, config, {})  # names only: no tensor is read
  with pytest.raises(ValueError, match=r"max_model_len=65 exceeds .*max_position_embeddings=64"):
    llm_module.LLM(str(tmp_path), max_model_len=65)


def test_interactive_chat_outgrowing_max_model_len_drops_oldest_turns(
  monkeypatch, capsys, tiny_llm
):
  # Each turn is about 40 tokens (a byte per token), so the second message no longer fits with
  # the first turn and room for 16 new tokens; the long message does not fit even alone.
  lines = ["first question", "second question", "x" * 200, "third question", "fourth question"]
  monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
  argv = ["chat", "--system", "Be brief.", "--max-tokens", "16", "--ignore-eos"]
  assert cli.main([*argv, *TINY_CHAT]) == 0
  captured = capsys.readouterr()
  assert ">>>" not in captured.out  # piped input: no prompts
  notices = captured.err.splitlines()
  assert "jaxengine: dropped the oldest 1 turn(s) of the conversation" in notices[0]
  assert sum("dropped the oldest" in n for n in notices) == 3  # second, third, fourth question
  (refusal,) = [n for n in notices if "does not fit" in n]
  assert "--max-model-len is 96" in refusal and "not sent" in refusal


def test_chat_prompt_keeps_the_system_prompt_and_the_latest_message():
  tokenizer = chatml_byte_tokenizer()
  messages = [{"role": "system", "content": "S"}]
  for i in range(5):
    messages += [{"role": "user", "content": f"q{i}" * 5}, {"role": "assistant", "content": "a"}]
  messages.append({"role": "user", "content": "last"})
  prompt = cli._chat_prompt(tokenizer, messages, max_model_len=80, room=1000)
  assert prompt.messages[0] == messages[0] and prompt.messages[-1] == messages[-1]
  assert prompt.messages[1:] == messages[len(messages) - len(prompt.messages) + 1 :]
  assert prompt.num_dropped == (len(messages) - len(prompt.messages)) // 2 > 0
  assert len(prompt.prompt_token_ids) + 40 <= 80  # room is capped at half of max_model_len
  assert prompt.prompt_token_ids == tokenizer.encode(prompt.text, add_special_tokens=False)
  assert len(messages) == 12  # the caller's list is left alone


def test_one_shot_chat_that_does_not_fit_exits_2(capsys, tiny_llm):
  assert cli.main(["chat", "x" * 100, "--max-model-len", "64"]) == 2
  err = capsys.readouterr().err
  assert "does not fit" in err and "--max-model-len is 64" in err


@pytest.mark.parametrize(
  "flags, expected",
  [
    (["--stop-token-ids", "2"], [2]),
    (["--stop-token-ids", "2,3"], [2, 3]),
    (["--stop-token-ids", "2", "--stop-token-ids", "3,4"], [2, 3, 4]),
    ([], None),
  ],
)
def test_stop_token_ids_leave_the_prompt_alone(flags, expected):
  args = cli.build_parser().parse_args(["generate", *flags, "Hi"])
  assert args.prompts == ["Hi"] and args.stop_token_ids == expected
  assert cli._sampling_params(args).stop_token_ids == (
    None if expected is None else tuple(expected)
  )


@pytest.mark.parametrize(
  "flags, named",
  [
    (["--stop-token-ids", "two"], "--stop-token-ids"),
    (["--stop-token-ids", "2,,3"], "--stop-token-ids"),
    (["--stop-token-ids", "-1"], "--stop-token-ids"),
    (["--max-num-reqs", "0"], "--max-num-reqs"),
    (["--max-num-reqs", "many"], "--max-num-reqs"),
    (["--max-model-len", "-5"], "--max-model-len"),
    (["--dtype", "float8"], "--dtype"),
    (["--speculative-config", "ngram"], "--speculative-config"),
    (["--speculative-config", '{"method": "eagle"}'], "--speculative-config"),
  ],
)
def test_bad_engine_and_stop_flags_are_usage_errors_before_loading(
  monkeypatch, capsys, flags, named
):
  _no_model_load(monkeypatch)
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["generate", *flags, "Hi"])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert f"argument {named}:" in err and repr(flags[1]) in err


def test_model_that_is_not_gguf_is_named(tmp_path, capsys):
  path = tmp_path / "README.md"
  path.write_text("# not a model\n")
  with pytest.raises(ValueError, match=r"README\.md.* is not a valid GGUF file"):
    gguf_loader.open_gguf(path)
  assert cli.main(["generate", "Hi", "--model", str(path)]) == 2
  err = capsys.readouterr().err
  assert str(path) in err and "not a valid GGUF file" in err


def test_help_of_each_command_reads_well(capsys):
  for argv, words in [
    ([], ["generate", "chat"]),
    (["generate"], ["PROMPT", "--stop-token-ids IDS", "comma-separated", "--max-num-reqs"]),
    (["chat"], ["MESSAGE", "--system", "--stop-token-ids IDS", "--max-model-len"]),
  ]:
    with pytest.raises(SystemExit) as exit_info:
      cli.main([*argv, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert all(word in out for word in words), out
    assert all(len(line) <= 100 for line in out.splitlines())


@pytest.mark.parametrize(
  "command, needed",
  [("generate", []), ("chat", []), ("serve", []), ("compile", ["--topology", "v5e:1x1"])],
)
def test_an_unknown_flag_is_reported_with_its_commands_usage(capsys, command, needed):
  with pytest.raises(SystemExit) as exit_info:
    cli.main([command, *needed, "--no-such-flag", "x"])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert f"jaxengine {command}: error: unrecognized arguments: --no-such-flag" in err
  assert f"usage: jaxengine {command} " in err


def test_serve_refuses_a_background_compile_of_nothing_before_loading(monkeypatch, capsys):
  from jaxengine.entrypoints import serve

  def no_load(args):
    raise AssertionError("the model must not load")

  monkeypatch.setattr(serve, "load_engine", no_load)
  assert cli.main(["serve", "--no-precompile", "--precompile-in-background"]) == 2
  out = capsys.readouterr().out
  assert "--precompile-in-background" in out and "--no-precompile" in out
