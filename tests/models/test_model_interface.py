"""`check_model` and `LLM` refuse an object that is not a `jaxengine.models.Model` by name."""

import pytest

import jaxengine as je
from jaxengine.engine import model_loader
from jaxengine.models import check_model
from jaxengine.testing import tiny_llama


class NoLogits:
  """Has the properties but neither `compute_logits` nor a `__call__`."""

  vocab_size = 8
  eos_token_id = None
  max_position_embeddings = 16
  kv_cache_spec = None


def test_check_model_names_missing_methods_with_a_value_error():
  with pytest.raises(
    ValueError, match=r"NoLogits does not implement .*'__call__', 'compute_logits'"
  ):
    check_model(NoLogits())


def test_llm_refuses_a_non_model_before_turning_on_the_compilation_cache(monkeypatch):
  """`tiny_llama()` returns `(model, config)`: passing the pair is a ValueError naming the tuple,
  raised before `LLM` turns on the process-wide compilation cache."""
  calls = []
  monkeypatch.setattr(model_loader, "enable_compilation_cache", lambda *a: calls.append(a))
  with pytest.raises(ValueError, match=r"tuple does not implement jaxengine\.models\.Model"):
    je.LLM(tiny_llama(), max_num_reqs=2, max_model_len=32)
  assert calls == []
