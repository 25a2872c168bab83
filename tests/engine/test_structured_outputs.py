"""Structured outputs (llguidance) and a custom processor on the real SmolLM2 model."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from byte_tokenizer import byte_tokenizer

import jaxengine as je
from jaxengine.cli.main import _sampling_params, build_parser
from jaxengine.engine.structured import StructuredOutputs
from jaxengine.testing import TargetOnly

SCHEMA = {
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
  },
  "required": ["name", "age", "pets"],
  "additionalProperties": False,
}
PHONE = r"\d{3}-\d{4}"
CHOICES = ["positive", "negative", "neutral"]


@pytest.fixture(scope="module")
def llm():
  return je.LLM(max_num_reqs=8, max_model_len=128, logits_processors=[TargetOnly])


def _so(**kwargs) -> je.SamplingParams:
  extra = {k: kwargs.pop(k) for k in ("temperature", "seed", "extra_args") if k in kwargs}
  so = je.StructuredOutputsParams(**kwargs) if kwargs else None
  return je.SamplingParams(max_tokens=48, structured_outputs=so, **extra)


def test_structured_and_plain_requests_side_by_side(llm):
  engine = llm.llm_engine
  for so in (
    je.StructuredOutputsParams(json={"type": "nonsense-type"}),
    je.StructuredOutputsParams(json="{not json"),
    je.StructuredOutputsParams(regex="(unclosed"),
    je.StructuredOutputsParams(grammar="start: undefined_rule"),
  ):
    with pytest.raises(ValueError, match="structured_outputs"):
      engine.add_request(None, "Hi", je.SamplingParams(structured_outputs=so))
  with pytest.raises(ValueError, match="target_token"):
    engine.add_request(None, "Hi", je.SamplingParams(extra_args={"target_token": -1}))
  assert not engine.has_unfinished_requests()
  # The engine keeps working: structured, plain and processor requests in one batch.
  reference = json.loads(
    (Path(__file__).parents[1] / "fixtures" / "smollm2_greedy.json").read_text()
  )
  plain = je.SamplingParams(temperature=0, max_tokens=len(reference["new_ids"]))
  prompts = [
    "Describe a person as JSON:",
    "Describe a person as JSON:",
    "Describe a person as JSON:",
    "A phone number:",
    "Review: great film! Sentiment:",
    reference["prompt"],
    "Say anything:",
    "Is the sky blue?",
  ]
  params = [
    _so(json=SCHEMA, temperature=0),
    _so(json=json.dumps(SCHEMA), seed=1),
    _so(json=SCHEMA, seed=2, temperature=1.2),
    _so(regex=PHONE, seed=3),
    _so(choice=CHOICES, temperature=0),
    plain,
    _so(extra_args={"target_token": 42}, seed=4),
    _so(json_object=True, temperature=0),
  ]
  outs = llm.generate(prompts, params, use_tqdm=False)
  for out in outs[:3]:
    completion = out.outputs[0]
    assert completion.finish_reason == "stop", completion
    jsonschema.validate(json.loads(completion.text), SCHEMA)
  assert re.fullmatch(PHONE, outs[3].outputs[0].text)
  assert outs[3].outputs[0].finish_reason == "stop"
  assert outs[4].outputs[0].text in CHOICES
  # A plain request beside structured ones emits exactly what it emits alone.
  assert outs[5].outputs[0].token_ids == reference["new_ids"]
  assert set(outs[6].outputs[0].token_ids) == {42}
  if outs[7].outputs[0].finish_reason == "stop":
    assert isinstance(json.loads(outs[7].outputs[0].text), dict)


@pytest.mark.parametrize(
  "flags, expected",
  [
    (["--regex", PHONE], je.StructuredOutputsParams(regex=PHONE)),
    (["--choice", "a", "--choice", "b c"], je.StructuredOutputsParams(choice=["a", "b c"])),
    (["--json-schema", json.dumps(SCHEMA)], je.StructuredOutputsParams(json=json.dumps(SCHEMA))),
  ],
)
def test_cli_structured_output_flags(flags, expected):
  args = build_parser().parse_args(["generate", "x", *flags, "--extra-args", '{"k": 1}'])
  params = _sampling_params(args)
  assert params.structured_outputs == expected
  assert params.extra_args == {"k": 1}


def test_cli_json_schema_from_a_file(tmp_path):
  path = tmp_path / "schema.json"
  path.write_text(json.dumps(SCHEMA))
  args = build_parser().parse_args(["generate", "x", "--json-schema", str(path)])
  assert json.loads(_sampling_params(args).structured_outputs.json) == SCHEMA


def test_a_token_the_grammar_rejects_is_dropped_and_aborts(llm):
  """Another constraint that leaves only tokens the grammar forbids never yields text the grammar
  forbids: refused at add time where it can be checked (allowed_token_ids), else the token is
  dropped and the request ends with "abort" and a warning."""
  yes_no = je.StructuredOutputsParams(choice=["yes", "no"])
  sp = lambda **kw: je.SamplingParams(structured_outputs=yes_no, temperature=0, max_tokens=4, **kw)
  with pytest.raises(ValueError, match=r"allowed_token_ids .* leave nothing to sample"):
    llm.generate("Is water wet?", sp(allowed_token_ids=[42]), use_tqdm=False)
  with pytest.warns(RuntimeWarning, match="does not allow"):
    (out,) = llm.generate("Is water wet?", sp(extra_args={"target_token": 42}), use_tqdm=False)
  assert (out.outputs[0].text, out.outputs[0].token_ids, out.outputs[0].finish_reason) == (
    "",
    [],
    "abort",
  )
  tokenizer = llm.get_tokenizer()
  (yes,) = tokenizer.encode("yes", add_special_tokens=False)
  (out,) = llm.generate(
    "Is water wet?", sp(allowed_token_ids=[yes, tokenizer.eos_token_id]), use_tqdm=False
  )
  assert (out.outputs[0].text, out.outputs[0].finish_reason) == ("yes", "stop")


def test_raw_logprobs_see_the_grammar_mask(llm):
  """vLLM V1 applies the grammar bitmask before its sampler computes raw logprobs: the greedy
  token has rank 1, every token the grammar forbids is -inf, and the allowed tokens'
  probabilities sum to 1 (20 top entries cover every allowed first token here)."""
  params = [
    je.SamplingParams(temperature=0, logprobs=20, max_tokens=8, structured_outputs=so)
    for so in (
      je.StructuredOutputsParams(choice=["yes", "no"]),
      je.StructuredOutputsParams(regex="[0-9]{4}"),  # \\d would allow Unicode digits' bytes
    )
  ]
  outs = llm.generate(["Is water wet?", "The year Columbus sailed:"], params, use_tqdm=False)
  prefix_of_a_choice = lambda text: "yes".startswith(text) or "no".startswith(text)
  for out, allowed in zip(outs, [prefix_of_a_choice, str.isdigit]):
    completion = out.outputs[0]
    assert completion.finish_reason == "stop"
    assert len(completion.logprobs) == len(completion.token_ids)
    for token, entries in zip(completion.token_ids, completion.logprobs):
      assert entries[token].rank == 1, (token, entries)
    first = completion.logprobs[0]
    finite = [lp for lp in first.values() if lp.logprob > float("-inf")]
    assert all(lp.decoded_token and allowed(lp.decoded_token) for lp in finite), first
    assert sum(math.exp(lp.logprob) for lp in finite) == pytest.approx(1.0, abs=1e-4)
  assert outs[0].outputs[0].text in ("yes", "no")
  assert re.fullmatch("[0-9]{4}", outs[1].outputs[0].text)


def test_a_finished_grammar_emits_eos_as_vllm_does(llm):
  """A finished grammar allows only EOS: the sampler emits it and the request stops on it, with
  EOS in token_ids and logprobs (logprob 0: the only allowed token) but not in the text, as in
  vLLM; also with ignore_eos. A constraint that masks EOS ends the request without it."""
  tokenizer = llm.get_tokenizer()
  eos = tokenizer.eos_token_id
  (yes,) = tokenizer.encode("yes", add_special_tokens=False)
  (no,) = tokenizer.encode("no", add_special_tokens=False)
  only_yes = je.StructuredOutputsParams(choice=["yes"])
  sp = lambda **kw: je.SamplingParams(
    **{"temperature": 0, "max_tokens": 8, "structured_outputs": only_yes, **kw}
  )
  outs = llm.generate(
    ["Is water wet?"] * 4,
    [
      sp(logprobs=2),
      sp(ignore_eos=True),
      sp(include_stop_str_in_output=True, skip_special_tokens=False),
      sp(allowed_token_ids=[yes, no]),
    ],
    use_tqdm=False,
  )
  done = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]
  assert done[0] == ([yes, eos], "yes", "stop")
  assert done[1] == ([yes, eos], "yes", "stop")
  assert done[2] == ([yes, eos], "yes" + tokenizer.decode([eos], False), "stop")
  assert done[3] == ([yes], "yes", "stop")
  assert outs[0].outputs[0].stop_reason is None
  logprobs = outs[0].outputs[0].logprobs
  assert len(logprobs) == 2 and logprobs[1][eos].logprob == 0.0 and logprobs[1][eos].rank == 1
  assert outs[0].outputs[0].cumulative_logprob == pytest.approx(logprobs[0][yes].logprob)
  # max_tokens still wins: no room left for EOS.
  (out,) = llm.generate("Is water wet?", sp(max_tokens=1), use_tqdm=False)
  assert (out.outputs[0].token_ids, out.outputs[0].finish_reason) == ([yes], "length")


@pytest.mark.parametrize(
  "engine_kwargs",
  [
    {"num_decode_steps": 4},
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
  ],
  ids=["multi_step", "speculative"],
)
def test_grammars_behave_alike_under_multi_step_and_speculative_engines(llm, engine_kwargs):
  """A grammar row runs one step at a time on these engines (its bitmask covers one position);
  its tokens, EOS and raw logprobs match the plain engine's, and a plain row beside it too."""
  params = [
    je.SamplingParams(
      temperature=0,
      logprobs=2,
      max_tokens=12,
      structured_outputs=je.StructuredOutputsParams(choice=["yes", "no"]),
    ),
    je.SamplingParams(
      temperature=0, logprobs=2, structured_outputs=je.StructuredOutputsParams(regex=PHONE)
    ),
    je.SamplingParams(temperature=0, logprobs=2, max_tokens=12),
  ]
  prompts = ["Is water wet?", "A phone number:", "Count: 1 2 3 1 2 3 1 2 3"]
  expected = llm.generate(prompts, params, use_tqdm=False)
  # The fixture's settings, its steps in the 4-row bucket only (and its 8-row sampler), where the
  # fixture ran these three rows: those model steps and samplers are the fixture's executables,
  # compiled already, and only the k-step loop or the verify step is new. Grammars under these
  # engines are the point here, not row buckets (tests/worker/test_step_shapes.py).
  other = je.LLM(max_num_reqs=8, max_model_len=128, logits_processors=[TargetOnly], **engine_kwargs)
  other.llm_engine.runner.row_buckets = [4, 8]  # three rows at most: never the 8-row model step
  outs = other.generate(prompts, params, use_tqdm=False)
  for out, ref in zip(outs, expected):
    got, want = out.outputs[0], ref.outputs[0]
    assert (got.token_ids, got.text, got.finish_reason) == (
      want.token_ids,
      want.text,
      want.finish_reason,
    )
    for a, b in zip(got.logprobs, want.logprobs):
      assert a.keys() == b.keys()
      for t in a:
        assert a[t].rank == b[t].rank
        assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)
  assert outs[0].outputs[0].token_ids[-1] == llm.get_tokenizer().eos_token_id


def _first_tokens(so: je.StructuredOutputsParams, prefix: bytes = b"") -> set[bytes]:
  """The tokens (each one byte) a byte-level vocabulary's matcher allows after `prefix`."""
  tokenizer = byte_tokenizer()
  eos, vocab_size = tokenizer.eos_token_id, len(tokenizer.hf_tokenizer)
  outputs = StructuredOutputs(tokenizer, vocab_size, eos, max_num_reqs=1)
  outputs.add("r", outputs.compile(so))
  for token in outputs.ll_tokenizer.tokenize_bytes(prefix):
    outputs.advance("r", token)
  words = outputs.bitmask(["r"])[0].view(np.uint32)
  ids = [i for i in range(vocab_size) if i != eos and words[i >> 5] >> (i & 31) & 1]
  return {outputs.ll_tokenizer.decode_bytes([i]) for i in ids}


@pytest.mark.parametrize(
  "regex, allowed",
  [
    (r"\d", "0123456789"),
    (r"[\d]", "0123456789"),
    (r"[x\d]", "0123456789x"),
    (r"\d{3}-\d{4}", "0123456789"),
    (r"\w", "0123456789_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"),
    (r"\\d", "\\"),  # an escaped backslash, then a literal d
  ],
)
def test_regex_digit_and_word_classes_are_ascii(regex, allowed):
  """`\\d` is [0-9] and `\\w` [0-9A-Za-z_] (JSON Schema's and vLLM's meaning), also inside a
  character class: no byte that starts a non-ASCII digit (the "٣" or "🯱" of a sample) is allowed,
  where llguidance's own Unicode classes allow them."""
  tokens = _first_tokens(je.StructuredOutputsParams(regex=regex))
  assert tokens == {c.encode() for c in allowed}


def test_regex_negated_digit_class_admits_everything_but_ascii_digits():
  tokens = _first_tokens(je.StructuredOutputsParams(regex=r"[^\d]"))
  assert "٣".encode()[:1] in tokens and b"a" in tokens  # "٣" is not [0-9]
  assert not tokens & {c.encode() for c in "0123456789"}


def test_json_schema_pattern_digits_are_ascii():
  schema = {"type": "string", "pattern": r"^\d+$"}
  tokens = _first_tokens(je.StructuredOutputsParams(json=schema), prefix=b'"')
  assert tokens == {c.encode() for c in "0123456789"}
