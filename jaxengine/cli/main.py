"""The `jaxengine` command: `jaxengine generate PROMPT...`, `jaxengine chat [MESSAGE]` and
`jaxengine serve [MODEL]` (an OpenAI-compatible server: `jaxengine/entrypoints/serve.py`) and
`jaxengine eval ARGS...` (lm-evaluation-harness's command with the ``jaxengine`` model:
`jaxengine/integrations/lm_eval.py`).

Also `python -m jaxengine`. Sampling flags mirror `SamplingParams` field names (`--top-p` is
`top_p`), with one difference: `--temperature` defaults to 0 (greedy) where `SamplingParams`
defaults to 1; a sampling-only flag (`--top-k`, `--top-p`, `--min-p`, `--seed`) without
`--temperature` is then an error, not silently ignored. Text streams to stdout as it is
generated when there is one completion; with several, each is printed when it finishes.
`--logprobs N` prints a per-token table afterwards. Engine and sampling flags, a
`--json-schema` (file or text), `--regex` or `--choice` constraint (llguidance validates it
without the tokenizer) and `--max-model-len` (against the model's config) are checked before
the weights load.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from jaxengine.cli.checks import (
  check_greedy_default,
  completion_header,
  read_json_schema,
  token_id_list,
)
from jaxengine.cli.compile_command import add_compile_parser, run_compile
from jaxengine.engine.engine_flags import add_engine_flags, engine_options
from jaxengine.entrypoints.chat_session import chat_prompt as _chat_prompt
from jaxengine.entrypoints.chat_session import read_message as _read_message
from jaxengine.entrypoints.serve import add_serve_flags
from jaxengine.params import SamplingParams, StructuredOutputsParams


class _HelpFormatter(argparse.HelpFormatter):
  """Shows each flag's default after its help, except None (unset) and a switch's False."""

  def _get_help_string(self, action: argparse.Action) -> str | None:
    unset = action.default is None or action.default is argparse.SUPPRESS
    if unset or action.nargs == 0 or "%(default)" in (action.help or ""):
      return action.help
    return f"{action.help or ''} (default: %(default)s)"


def _add_sampling_flags(parser: argparse.ArgumentParser, max_tokens: int) -> None:
  """Adds one flag per supported `SamplingParams` field; `max_tokens` is the command's default."""
  group = parser.add_argument_group("sampling (SamplingParams fields)")
  group.add_argument(
    "--temperature",
    metavar="T",
    type=float,
    default=None,
    help="default 0 = greedy (SamplingParams defaults to 1.0); --top-p, --top-k, --min-p, "
    "--seed and --n > 1 need a temperature > 0",
  )
  group.add_argument(
    "--top-p",
    metavar="P",
    type=float,
    default=1.0,
    help="keep the most likely tokens up to this mass; 1 = off (needs --temperature)",
  )
  group.add_argument(
    "--top-k",
    metavar="K",
    type=int,
    default=0,
    help="keep the K most likely tokens; 0 = off (needs --temperature)",
  )
  group.add_argument(
    "--min-p",
    metavar="P",
    type=float,
    default=0.0,
    help="drop tokens below min-p x the top probability (needs --temperature)",
  )
  group.add_argument(
    "--presence-penalty",
    metavar="X",
    type=float,
    default=0.0,
    help="-2..2, once per token in the output",
  )
  group.add_argument(
    "--frequency-penalty",
    metavar="X",
    type=float,
    default=0.0,
    help="-2..2, per occurrence in the output",
  )
  group.add_argument(
    "--repetition-penalty",
    metavar="X",
    type=float,
    default=1.0,
    help="> 0, on tokens seen in prompt or output; 1 = off",
  )
  group.add_argument(
    "--max-tokens", metavar="N", type=int, default=max_tokens, help="most tokens generated"
  )
  group.add_argument(
    "--min-tokens",
    metavar="N",
    type=int,
    default=0,
    help="tokens generated before EOS or stop ids may end",
  )
  group.add_argument(
    "--seed",
    metavar="SEED",
    type=int,
    default=None,
    help="per-request seed (unset: drawn from --engine-seed; needs --temperature)",
  )
  group.add_argument("--n", metavar="N", type=int, default=1, help="completions per prompt")
  group.add_argument(
    "--stop", action="append", default=None, metavar="TEXT", help="stop string (repeatable)"
  )
  group.add_argument(
    "--stop-token-ids",
    type=token_id_list,
    action="extend",
    default=None,
    metavar="IDS",
    help="comma-separated token ids that end generation, e.g. 2,3 (repeatable)",
  )
  group.add_argument("--ignore-eos", action="store_true", help="do not stop at end of sequence")
  group.add_argument(
    "--logprobs",
    metavar="N",
    type=int,
    default=None,
    help="print the top N log-probabilities of each generated token",
  )


def _add_structured_flags(parser: argparse.ArgumentParser) -> None:
  """Adds --json-schema, --regex, --choice (structured outputs), --logits-processor, --extra-args."""
  group = parser.add_argument_group("structured outputs and logits processors")
  group.add_argument("--json-schema", metavar="SCHEMA", help="JSON schema (text or a file path)")
  group.add_argument("--regex", metavar="PATTERN", help="regex the output must fully match")
  group.add_argument("--choice", metavar="TEXT", action="append", help="allowed output (repeat)")
  group.add_argument(
    "--logits-processor", metavar="MODULE:CLASS", action="append", help="a LogitsProcessor (repeat)"
  )
  group.add_argument("--extra-args", metavar="JSON", help="SamplingParams.extra_args as JSON")


def _structured_outputs(args: argparse.Namespace) -> StructuredOutputsParams | None:
  """`StructuredOutputsParams` from the flags, or None. Raises `ValueError` for bad values,
  before any model loads: a `--json-schema` that is neither a file nor JSON, or a schema,
  pattern or choice llguidance refuses."""
  schema = None if args.json_schema is None else read_json_schema(args.json_schema)
  given = dict(json=schema, regex=args.regex, choice=args.choice)
  if all(v is None for v in given.values()):
    return None
  so = StructuredOutputsParams(**given)
  from jaxengine.engine.structured import checked_grammar  # imported late: `--help` stays fast

  checked_grammar(so)
  return so


def _extra_args(text: str | None) -> dict | None:
  try:
    return None if text is None else json.loads(text)
  except json.JSONDecodeError as error:
    raise ValueError(f"--extra-args must be a JSON object: {error}") from None


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
  """The `SamplingParams` the parsed flags describe. Raises `ValueError` for invalid values."""
  params = SamplingParams(
    structured_outputs=_structured_outputs(args),
    extra_args=_extra_args(args.extra_args),
    temperature=0.0 if args.temperature is None else args.temperature,
    top_p=args.top_p,
    top_k=args.top_k,
    min_p=args.min_p,
    presence_penalty=args.presence_penalty,
    frequency_penalty=args.frequency_penalty,
    repetition_penalty=args.repetition_penalty,
    max_tokens=args.max_tokens,
    min_tokens=args.min_tokens,
    seed=args.seed,
    n=args.n,
    stop=args.stop,
    stop_token_ids=args.stop_token_ids,
    ignore_eos=args.ignore_eos,
    logprobs=args.logprobs,
  )
  check_greedy_default(args)  # after the values' own checks
  return params


class _CommandLine(argparse.ArgumentParser):
  """The top-level parser: an unknown flag is reported with its subcommand's usage line (plain
  argparse reports it with the top-level one, `jaxengine [-h] COMMAND ...`)."""

  def __init__(self, **kwargs) -> None:
    super().__init__(**kwargs)
    #: Each subcommand's parser, by name (set by `build_parser`).
    self.command_parsers: dict[str, argparse.ArgumentParser] = {}

  def parse_args(self, args=None, namespace=None):
    parsed, extra = self.parse_known_args(args, namespace)
    if extra:
      owner = self.command_parsers.get(getattr(parsed, "command", None) or "", self)
      owner.error(f"unrecognized arguments: {' '.join(extra)}")
    return parsed


def build_parser() -> argparse.ArgumentParser:
  """The argument parser of the `jaxengine` command.

  Subcommands: `generate PROMPT [PROMPT ...]` (`--max-tokens` default 64) and `chat [MESSAGE]`
  (`--system`; `--max-tokens` default 256; interactive without MESSAGE). Both take the sampling
  flags (`--temperature` default 0, greedy: then `--top-p`, `--top-k`, `--min-p`, `--seed`
  and `--n` > 1 are refused; `--top-p`, `--top-k`, `--min-p`, the three penalties,
  `--min-tokens`, `--seed`, `--n`, repeatable `--stop`, `--stop-token-ids` (comma-separated,
  repeatable), `--ignore-eos`, `--logprobs`) and the engine flags (`--model` GGUF path, Hugging
  Face directory or hub id, `--max-num-reqs` default 16, `--max-model-len` default the model's
  `max_position_embeddings`, both positive, `--dtype` auto (default), float32, bfloat16 or
  float16, `--enforce-eager` and `--trust-remote-code` (vLLM's flags, accepted without effect)).

  Returns:
    An `argparse.ArgumentParser`; a missing subcommand is a usage error.
  """
  parser = _CommandLine(
    prog="jaxengine",
    description="Generate text on JAX with a Llama-family or Gemma model (GGUF file or Hugging "
    "Face checkpoint: Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3).",
  )
  commands = parser.add_subparsers(
    dest="command",
    required=True,
    title="commands",
    metavar="COMMAND",
    description="`jaxengine COMMAND --help` lists the flags of each.",
  )
  generate = commands.add_parser(
    "generate",
    help="continue one or more prompts",
    description="Continue each PROMPT; one completion streams as it is generated.",
    formatter_class=_HelpFormatter,
  )
  generate.add_argument("prompts", nargs="+", metavar="PROMPT", help="text to continue")
  _add_sampling_flags(generate, max_tokens=64)
  _add_structured_flags(generate)
  add_engine_flags(generate)
  chat = commands.add_parser(
    "chat",
    help="chat with the model (interactive without MESSAGE)",
    description=(
      "Reply to MESSAGE with the model's chat template, or without MESSAGE read one message per "
      "line until end of input, /exit or /quit. When the conversation outgrows --max-model-len "
      "its oldest turns are left out (the system prompt is kept)."
    ),
    formatter_class=_HelpFormatter,
  )
  chat.add_argument(
    "message", nargs="?", default=None, metavar="MESSAGE", help="one message; none: interactive"
  )
  chat.add_argument("--system", metavar="TEXT", default=None, help="system prompt")
  _add_sampling_flags(chat, max_tokens=256)
  _add_structured_flags(chat)
  add_engine_flags(chat)
  serve = commands.add_parser(
    "serve",
    help="serve the model over HTTP (OpenAI-compatible API)",
    description="Serve MODEL with OpenAI's /v1/completions and /v1/chat/completions.",
    formatter_class=_HelpFormatter,
  )
  add_serve_flags(serve)
  add_engine_flags(serve)
  add_compile_parser(commands, _HelpFormatter)
  commands.add_parser(  # `main` hands the arguments to lm-eval before this parser runs
    "eval",
    help="evaluate with lm-evaluation-harness (ARGS are lm-eval's; needs jaxengine[lm-eval])",
    add_help=False,
  )
  parser.command_parsers = dict(commands.choices)
  return parser


def _stream(llm, prompts: list, params: SamplingParams, out=None, label_prompts=True) -> list:
  """Runs the engine, streaming text when there is a single completion; returns the outputs.

  Several completions are printed as each finishes, under `--- [request.sample] prompt` (or
  `--- sample i of n` with `label_prompts=False`: a chat's prompt is template text)."""
  out = out or sys.stdout  # looked up per call, so redirected output is honoured
  engine = llm.llm_engine
  ids = engine.add_requests([(None, p, params) for p in prompts])
  streaming = len(ids) == 1 and params.n == 1
  if streaming and isinstance(prompts[0], str):
    out.write(prompts[0])
  # Hold back text that could still turn out to start a stop string (it is cut if it does).
  hold = max((len(s) for s in params.stop or ()), default=1) - 1
  printed = 0
  finished = {}
  while engine.has_unfinished_requests():
    outputs = engine.step()
    for output in outputs:
      if streaming:
        completion = output.outputs[0]
        end = len(completion.text) if completion.finished() else len(completion.text) - hold
        if end > printed:
          out.write(completion.text[printed:end])
          out.flush()
          printed = end
    for output in [o for o in outputs if o.finished] + engine.pop_finished():
      finished[output.request_id] = output
      if not streaming:
        for completion in output.outputs:
          out.write(completion_header(output, completion, params.n, label_prompts))
          out.write(completion.text + "\n")
  if streaming:
    out.write("\n")
  return [finished[i] for i in ids]


def _print_logprobs(outputs, out=None) -> None:
  """Prints, per completion with logprobs, one line per token: text, logprob, rank, top others."""
  out = out or sys.stdout
  for output in outputs:
    for completion in output.outputs:
      if completion.logprobs is None:
        continue
      out.write(
        f"logprobs of [{output.request_id}.{completion.index}] "
        f"(cumulative {completion.cumulative_logprob:.4f}):\n"
      )
      for token_id, entries in zip(completion.token_ids, completion.logprobs):
        chosen = entries[token_id]
        others = ", ".join(
          f"{e.decoded_token!r}:{e.logprob:.3f}" for t, e in entries.items() if t != token_id
        )
        out.write(
          f"  {chosen.decoded_token!r:>16} {chosen.logprob:8.4f} rank {chosen.rank:<5} {others}\n"
        )


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the `jaxengine` command.

  Args:
    argv: the arguments after the program name; None reads `sys.argv[1:]`.

  Returns:
    The exit status: 0 on success (or end of input in interactive chat), 1 when the model file
    is missing (the message on stderr gives the install command), 2 for `eval` without
    lm-eval installed (the message gives the extra's pip command), invalid sampling values,
    a file that is not a usable GGUF model, or a request the engine refuses (e.g. a prompt, or a
    `chat MESSAGE`, longer than `--max-model-len`). Interactive chat instead leaves out the
    oldest turns when the conversation outgrows `--max-model-len` (a notice on stderr), and
    skips a message that does not fit even alone.

  Raises:
    SystemExit: from argparse, for `--help` (status 0) and usage errors (status 2).
  """
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] == ["eval"]:  # every other argument is lm-eval's, `--help` included
    from jaxengine.integrations import MissingExtraError

    try:
      from jaxengine.integrations.lm_eval import main as eval_main
    except MissingExtraError as error:  # lm-eval is not installed
      print(f"jaxengine: {error}", file=sys.stderr)
      return 2
    return eval_main(argv[1:])
  args = build_parser().parse_args(argv)
  if args.command == "serve":
    from jaxengine.entrypoints.serve import run_server

    return run_server(args)
  if args.command == "compile":
    return run_compile(args)
  try:
    params = _sampling_params(args)
  except ValueError as error:
    print(f"jaxengine: {error}", file=sys.stderr)
    return 2
  from jaxengine.engine_config import EngineConfig  # imported late: `--help` stays fast
  from jaxengine.entrypoints.llm import LLM

  try:
    config = EngineConfig(**engine_options(args))  # checked before the model loads
    llm = LLM(args.model, config=config)
  except FileNotFoundError as error:
    print(f"jaxengine: {error}", file=sys.stderr)
    return 1
  except ValueError as error:  # bad engine settings, or a model file or directory not usable
    print(f"jaxengine: {error}", file=sys.stderr)
    return 2
  try:
    return _run(llm, args, params)
  except ValueError as error:  # a request the engine refuses (e.g. a prompt that is too long)
    print(f"jaxengine: {error}", file=sys.stderr)
    return 2


def _run(llm, args: argparse.Namespace, params: SamplingParams) -> int:
  """Runs the parsed command on a loaded `LLM`; returns the exit status (see `main`)."""
  if args.command == "generate":
    _print_logprobs(_stream(llm, list(args.prompts), params))
    return 0
  tokenizer = llm.get_tokenizer()
  max_model_len = llm.llm_engine.max_model_len
  history = [] if args.system is None else [{"role": "system", "content": args.system}]
  interactive = args.message is None
  while True:
    message = args.message if not interactive else _read_message()
    if message is None:
      return 0
    prompt = _chat_prompt(
      tokenizer,
      [*history, {"role": "user", "content": message}],
      max_model_len,
      params.max_tokens or max_model_len,
    )
    if len(prompt.prompt_token_ids) >= max_model_len:  # the engine would refuse it
      print(
        f"jaxengine: the message does not fit: with the chat template"
        f"{' and the system prompt' if args.system is not None else ''} it is "
        f"{len(prompt.prompt_token_ids)} tokens; --max-model-len is {max_model_len}"
        + (" (not sent; the conversation is kept)" if interactive else ""),
        file=sys.stderr,
      )
      if not interactive:
        return 2
      continue
    if prompt.num_dropped:
      print(
        f"jaxengine: dropped the oldest {prompt.num_dropped} turn(s) of the conversation to fit "
        f"--max-model-len {max_model_len}",
        file=sys.stderr,
      )
    history = prompt.messages
    outputs = _stream(
      llm,
      [{"prompt": prompt.text, "prompt_token_ids": prompt.prompt_token_ids}],
      params,
      label_prompts=False,
    )
    _print_logprobs(outputs)
    history.append({"role": "assistant", "content": outputs[0].outputs[0].text})
    if not interactive:
      return 0
