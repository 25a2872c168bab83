"""Stop rules of the engine against vLLM's: stop strings, min_tokens, include_stop_str_in_output.

The engine cases run the real SmolLM2 model greedily on "The quick brown fox", whose first 12
tokens are " with a quick brown bear.\\n\\nThe original sentence is" (" with" is token 1, " a"
token 2, " brown" token 4).
"""

from __future__ import annotations

import pytest

import jaxengine as je
from jaxengine.engine import find_stop_string

PROMPT = "The quick brown fox"
GREEDY = je.SamplingParams(temperature=0, max_tokens=12)
FULL_TEXT = " with a quick brown bear.\n\nThe original sentence is"


@pytest.fixture(scope="module")
def llm():
  return je.LLM(max_num_reqs=4, max_model_len=128)


def _completion(llm, **params):
  (out,) = llm.generate(PROMPT, GREEDY.replace(**params), use_tqdm=False)
  return out.outputs[0]


def test_greedy_continuation_is_the_one_these_tests_assume(llm):
  completion = _completion(llm)
  assert completion.text == FULL_TEXT and completion.finish_reason == "length"


def test_an_unrelated_long_stop_string_does_not_change_the_result(llm):
  alone = _completion(llm, min_tokens=3, stop=[" with"])
  with_long = _completion(llm, min_tokens=3, stop=[" with", "x" * 20])
  assert alone.text == with_long.text == FULL_TEXT
  assert with_long.finish_reason == "length" and len(with_long.token_ids) == 12


def test_stop_strings_never_match_the_text_of_the_first_min_tokens_tokens(llm):
  # " with" is the whole text of token 1: with min_tokens=1 vLLM does not stop on it.
  completion = _completion(llm, min_tokens=1, stop=[" with"])
  assert completion.text == FULL_TEXT and completion.finish_reason == "length"
  # " a" is token 2, after min_tokens: it stops there.
  completion = _completion(llm, min_tokens=1, stop=[" a"])
  assert (completion.text, completion.stop_reason, len(completion.token_ids)) == (" with", " a", 2)


def test_the_stop_string_that_ends_first_wins(llm):
  # Both complete on " brown" (token 4); "k b" ends first in the text.
  completion = _completion(llm, stop=["quick brown", "k b"])
  assert (completion.text, completion.stop_reason) == (" with a quic", "k b")
  completion = _completion(llm, stop=["quick brown", "k b"], include_stop_str_in_output=True)
  assert completion.text == " with a quick b"


def test_include_stop_str_in_output_keeps_a_stop_tokens_text(llm):
  completion = _completion(llm, stop_token_ids=[253], include_stop_str_in_output=True)
  assert (completion.text, completion.stop_reason) == (" with a", 253)
  completion = _completion(llm, stop_token_ids=[253])
  assert completion.text == " with"


def test_include_stop_str_in_output_keeps_eos_unless_special_tokens_are_skipped(llm):
  messages = [{"role": "user", "content": "Say hi"}]
  params = je.SamplingParams(temperature=0, max_tokens=60, include_stop_str_in_output=True)
  eos = llm.get_tokenizer().decode([llm.get_tokenizer().eos_token_id], skip_special_tokens=False)
  (kept,) = llm.chat(messages, params.replace(skip_special_tokens=False), use_tqdm=False)
  (skipped,) = llm.chat(messages, params, use_tqdm=False)
  assert kept.outputs[0].finish_reason == "stop" and kept.outputs[0].text.endswith(eos)
  assert kept.outputs[0].text == skipped.outputs[0].text + eos


@pytest.mark.parametrize(
  ("text", "new", "stops", "start", "expected"),
  [
    ("abc with", 5, [" with", "x" * 20], 0, (" with", 3, 8)),
    ("abc with", 5, [" with"], 4, None),  # starts inside the first min_tokens' text
    ("abc with", 2, [" with"], 0, (" with", 3, 8)),  # completed by the last 2 characters
    ("abc with", 2, ["abc"], 0, None),  # ended before the new characters
    ("the quick brown", 6, ["quick brown", "k b"], 0, ("k b", 8, 11)),
    ("xaby", 2, ["ab", "xab"], 0, ("ab", 1, 3)),  # same end: the first in the list
  ],
)
def test_find_stop_string(text, new, stops, start, expected):
  match = find_stop_string(text, new, stops, start)
  assert (None if match is None else tuple(match)) == expected
