"""A byte-level tokenizer for engine tests on tiny models: text in, text out, no download."""

from __future__ import annotations

import tokenizers
from tokenizers import decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from jaxengine.tokenizer import Tokenizer


def byte_tokenizer() -> Tokenizer:
  """One token per byte plus an EOS (id 0)."""
  vocab = {t: i for i, t in enumerate(["<eos>", *sorted(pre_tokenizers.ByteLevel.alphabet())])}
  backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = decoders.ByteLevel()
  backend.add_special_tokens([tokenizers.AddedToken("<eos>", special=True)])
  return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>"))
