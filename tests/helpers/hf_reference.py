"""transformers' side of the model-family tests: a PyTorch model's prompt logprobs and greedy
tokens for one unpadded prompt (tests/models/test_gemma.py, test_gemma4.py, test_qwen3_5.py), and
the random PEFT adapters the LoRA tests load (`random_peft_adapter`)."""

from __future__ import annotations

import numpy as np
import torch


def hf_prompt_logprobs(model, prompt) -> np.ndarray:
  """``[T - 1]`` transformers' log-probability of each prompt token after the first."""
  with torch.no_grad():
    logits = model(torch.tensor([prompt])).logits[0].double()
  logprobs = torch.log_softmax(logits, -1)
  return logprobs[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].numpy()


def hf_greedy(model, prompt, max_new_tokens: int) -> list[int]:
  """transformers' `max_new_tokens` greedy tokens after `prompt` (no EOS stop)."""
  with torch.no_grad():
    out = model.generate(
      torch.tensor([prompt]),
      attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
      max_new_tokens=max_new_tokens,
      do_sample=False,
      eos_token_id=None,
      pad_token_id=0,
    )
  return out[0, len(prompt) :].tolist()


def random_peft_adapter(model, config, directory, seed: int = 0):
  """`peft.get_peft_model(model, config)` with every LoRA matrix drawn from ``N(0, 0.3^2)``
  (seeded; peft starts ``B`` at zero, which would change nothing), saved to `directory` as a PEFT
  adapter. Returns the wrapped model in eval mode."""
  import peft

  adapted = peft.get_peft_model(model, config)
  torch.manual_seed(seed)
  with torch.no_grad():
    for name, param in adapted.named_parameters():
      if "lora_" in name:
        param.normal_(0.0, 0.3)
  adapted.save_pretrained(directory)
  return adapted.eval()
