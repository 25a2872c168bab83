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


#: A ChatML chat template (Qwen's format), enough for `LLM.chat` and the server's chat route.
CHATML = (
  "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chatml_byte_tokenizer() -> Tokenizer:
  """One token per byte plus three specials (ids 0-2, EOS 2), with a ChatML template."""
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
  backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = decoders.ByteLevel()
  backend.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in specials])
  hf = PreTrainedTokenizerFast(
    tokenizer_object=backend, eos_token="<|im_end|>", chat_template=CHATML
  )
  return Tokenizer(hf)
