"""Tool-call and reasoning parsers on literal model outputs (no model): each format read whole
and streamed in pieces of every size, the streamed deltas adding up to the whole's message;
`tool_choice` checked against `tools`; the chat template given the tools and tool-call messages;
unknown parser names refused when the server starts."""

from __future__ import annotations

import json
import re

import pytest
from byte_tokenizer import chatml_byte_tokenizer

import jaxengine.cli.main as cli
from jaxengine.entrypoints import serve
from jaxengine.entrypoints.chat_messages import as_conversations, render_prompts
from jaxengine.entrypoints.chat_output import ChatOutputParser, ChatParserOptions
from jaxengine.entrypoints.openai_server import build_app
from jaxengine.entrypoints.protocol import ChatCompletionRequest, RequestError
from jaxengine.entrypoints.reasoning_parsers import REASONING_PARSERS
from jaxengine.entrypoints.tool_choice import (
  NamedFunctionParser,
  RequiredCallsParser,
  ToolChoiceError,
  effective_tool_choice,
  tool_call_constraint,
)
from jaxengine.entrypoints.tool_parsers import TOOL_PARSERS

WEATHER = {
  "type": "function",
  "function": {
    "name": "get_weather",
    "parameters": {
      "type": "object",
      "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "metric": {"type": "boolean"},
        "hours": {"type": "array"},
      },
    },
  },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, TIME]


def streamed(parser: ChatOutputParser, text: str, size: int) -> tuple[dict, list[dict]]:
  """The message the deltas of `text` (sent `size` characters at a time) add up to, as the
  openai client accumulates them, and the deltas."""
  stream = parser.stream()
  pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
  deltas = [stream.delta(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
  message: dict = {"content": None, "reasoning_content": None}
  calls: dict[int, dict] = {}
  for delta in deltas:
    for key in ("content", "reasoning_content"):
      if key in delta:
        message[key] = (message[key] or "") + delta[key]
    for call in delta.get("tool_calls", ()):
      if call["index"] not in calls:
        assert "id" in call and call["type"] == "function" and call["function"]["name"]
        calls[call["index"]] = {"name": call["function"]["name"], "arguments": ""}
      else:
        assert "id" not in call and "name" not in call["function"]  # the name comes first, once
      calls[call["index"]]["arguments"] += call["function"]["arguments"]
  assert sorted(calls) == list(range(len(calls)))
  message["tool_calls"] = [calls[i] for i in sorted(calls)]
  message["called"] = stream.tools_called
  return message, deltas


def whole(parser: ChatOutputParser, text: str) -> dict:
  message, called = parser.message(text)
  return {
    "content": message["content"],
    "reasoning_content": message.get("reasoning_content"),
    "tool_calls": [
      {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
      for c in message.get("tool_calls", ())
    ],
    "called": called,
  }


def assert_streams_as_whole(parser: ChatOutputParser, text: str) -> dict:
  """Every piece size streams to the whole's message; returns the whole's."""
  expected = whole(parser, text)
  for size in (1, 2, 3, 5, 8, len(text) or 1):
    assert streamed(parser, text, size)[0] == expected, size
  return expected


def auto(name: str, reasoning: str | None = None) -> ChatOutputParser:
  options = ChatParserOptions.from_names(True, name, reasoning)
  return options.output_parser(TOOLS, "auto")


HERMES_TWO_CALLS = (
  'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
  '\n</tool_call>\n<tool_call>\n{"arguments": {}, "name": "get_time"}\n</tool_call>'
)


def test_hermes_reads_calls_and_keeps_the_text_around_them_as_content():
  message = assert_streams_as_whole(auto("hermes"), HERMES_TWO_CALLS)
  assert message["content"] == "Let me look.\n" and message["called"]
  assert [c["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
  assert json.loads(message["tool_calls"][0]["arguments"]) == {"city": "Paris", "days": 2}
  assert message["tool_calls"][1]["arguments"] == "{}"
  # no call: all content; a call whose JSON is broken: all content, no calls (vLLM's rule)
  plain = "Paris is sunny <tool and <b>bold</b>."
  assert assert_streams_as_whole(auto("hermes"), plain)["content"] == plain
  broken = '<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>'
  assert whole(auto("hermes"), broken) == {
    "content": broken, "reasoning_content": None, "tool_calls": [], "called": False,
  }  # fmt: skip
  # only calls: content None; a call the output ends inside is read as far as its JSON goes
  only = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}'
  assert whole(auto("hermes"), only)["content"] is None
  assert whole(auto("hermes"), only)["tool_calls"] == [
    {"name": "get_time", "arguments": '{"zone": "UTC"}'}
  ]


def test_braces_and_quotes_inside_argument_strings_do_not_end_the_call():
  arguments = {"q": 'a "}" b {[', "n": [1, {"x": "\\"}], "t": True}
  text = f'<tool_call>{{"name": "get_time", "arguments": {json.dumps(arguments)}}}</tool_call>'
  (call,) = assert_streams_as_whole(auto("hermes"), text)["tool_calls"]
  assert json.loads(call["arguments"]) == arguments


def test_arguments_stream_in_fragments_after_the_name():
  _, deltas = streamed(auto("hermes"), HERMES_TWO_CALLS, 1)
  first = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
  assert first[0]["function"] == {"name": "get_weather", "arguments": ""}
  fragments = [c["function"]["arguments"] for c in first[1:] if c["index"] == 0]
  assert len(fragments) > 10 and "".join(fragments) == '{"city": "Paris", "days": 2}'
  # text that may open a tag is held back, then sent as content once it does not
  _, deltas = streamed(auto("hermes"), "a <tool b", 1)
  assert [d.get("content") for d in deltas if d] == ["a", " ", "<tool ", "b"]


def test_llama3_json_reads_semicolon_separated_calls_after_the_python_tag():
  text = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
    '{"name": "get_time", "arguments": {"zone": "CET"}}'
  )
  message = assert_streams_as_whole(auto("llama3_json"), text)
  assert message["content"] is None
  assert [(c["name"], json.loads(c["arguments"])) for c in message["tool_calls"]] == [
    ("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"}),
  ]  # fmt: skip
  bare = ' {"name": "get_time", "parameters": {}}'
  assert assert_streams_as_whole(auto("llama3_json"), bare)["tool_calls"] == [
    {"name": "get_time", "arguments": "{}"}
  ]
  text = "It is sunny."
  assert assert_streams_as_whole(auto("llama3_json"), text)["content"] == text


def test_qwen3_coder_types_parameters_by_the_tool_schema():
  text = (
    "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
    "<parameter=hours>\n[6, 12]\n</parameter>\n<parameter=note>\nline one\nline two\n"
    "</parameter>\n</function>\n</tool_call>"
  )
  message = assert_streams_as_whole(auto("qwen3_coder"), text)
  assert message["content"] == "Checking.\n"
  (call,) = message["tool_calls"]
  assert call["name"] == "get_weather"
  assert json.loads(call["arguments"]) == {
    "city": "New York", "days": 3, "metric": True, "hours": [6, 12], "note": "line one\nline two",
  }  # fmt: skip
  # a value that is not of its type stays text; a parameter left unclosed ends at the next
  text = (
    "<tool_call><function=get_weather><parameter=days>soon<parameter=city>Rome"
    "</function></tool_call>"
  )
  (call,) = assert_streams_as_whole(auto("qwen3_coder"), text)["tool_calls"]
  assert json.loads(call["arguments"]) == {"days": "soon", "city": "Rome"}


@pytest.mark.parametrize(
  ("name", "text", "reasoning", "content"),
  [
    ("qwen3", "<think>\nHmm.\n</think>\n\nParis.", "\nHmm.\n", "\n\nParis."),
    ("qwen3", "Paris.", None, "Paris."),
    ("qwen3", "<think>still thinking", "still thinking", None),
    ("deepseek_r1", "Hmm, France.</think>Paris.", "Hmm, France.", "Paris."),
    ("deepseek_r1", "<think>Hmm.</think>Paris.", "Hmm.", "Paris."),
    ("deepseek_r1", "all reasoning", "all reasoning", None),
  ],
)
def test_reasoning_parsers(name, text, reasoning, content):
  parser = ChatParserOptions.from_names(False, None, name).output_parser(None, "none")
  message = assert_streams_as_whole(parser, text)
  assert (message["reasoning_content"], message["content"]) == (reasoning, content)


def test_reasoning_then_a_tool_call():
  text = '<think>Need the weather.</think><tool_call>{"name": "get_time", "arguments": {}}'
  message = assert_streams_as_whole(auto("hermes", "qwen3"), text + "</tool_call>")
  assert message["reasoning_content"] == "Need the weather." and message["content"] is None
  assert message["tool_calls"] == [{"name": "get_time", "arguments": "{}"}]


def test_forced_calls_required_and_named():
  required = ChatOutputParser(None, RequiredCallsParser(TOOLS), "required")
  text = '[{"name":"get_weather","parameters":{"city":"Lima"}},{"name":"get_time","parameters":{}}]'
  message = assert_streams_as_whole(required, text)
  assert message["tool_calls"] == [
    {"name": "get_weather", "arguments": '{"city":"Lima"}'},
    {"name": "get_time", "arguments": "{}"},
  ]
  assert required.finish_reason(True, "stop") == "tool_calls"
  assert required.finish_reason(True, None) is None  # a streamed chunk before the last
  assert required.finish_reason(True, "length") == "length"
  named = ChatOutputParser(None, NamedFunctionParser("get_weather"), "named")
  message = assert_streams_as_whole(named, '{"city":"Lima"}')
  assert message["tool_calls"] == [{"name": "get_weather", "arguments": '{"city":"Lima"}'}]
  assert named.finish_reason(True, "stop") == "stop"  # OpenAI's, for a named function


@pytest.mark.parametrize(
  ("parser", "text", "calls"),
  [  # a call the output ends inside (max_tokens, or a <tool_call> never closed)
    ("hermes", 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Par',
     [{"name": "get_weather", "arguments": '{"city": "Par'}]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"na',
     [{"name": "get_time", "arguments": "{}"}]),  # the second cut before its name: dropped
    ("required", '[{"name":"get_time","parameters":{}},{"name":"get_weather","parameters":{"ci',
     [{"name": "get_time", "arguments": "{}"}, {"name": "get_weather", "arguments": '{"ci'}]),
    ("named", '{"city":"Li', [{"name": "get_weather", "arguments": '{"city":"Li'}]),
  ],
)  # fmt: skip
def test_a_call_cut_off_is_the_same_streamed_or_not_and_not_tool_calls(parser, text, calls):
  """The non-streamed message reports a cut-off call as the stream sent it (arguments as far
  as they go), and the choice keeps the engine's finish_reason: a client runs no partial call."""
  parser = {
    "hermes": auto("hermes"),
    "required": ChatOutputParser(None, RequiredCallsParser(TOOLS), "required"),
    "named": ChatOutputParser(None, NamedFunctionParser("get_weather"), "named"),
  }[parser]
  message = assert_streams_as_whole(parser, text)
  assert message["tool_calls"] == calls and not message["called"]
  assert message["content"] == ("Sure." if text.startswith("Sure.") else None)
  assert parser.finish_reason(message["called"], "length") == "length"
  assert parser.finish_reason(message["called"], "stop") == "stop"  # a tag left open: no run


def test_tool_choice_is_checked_against_the_tools():
  assert effective_tool_choice(TOOLS, None) == "auto"
  assert effective_tool_choice(None, None) == "none"
  named = {"type": "function", "function": {"name": "get_time"}}
  assert tool_call_constraint(TOOLS, named).json == {"type": "object"}
  schema = tool_call_constraint(TOOLS, "required").json
  assert schema["type"] == "array" and schema["minItems"] == 1
  assert [i["properties"]["name"]["enum"] for i in schema["items"]["anyOf"]] == [
    ["get_weather"], ["get_time"],
  ]  # fmt: skip
  for tools, choice, param, words in [
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice", "'nope'"),
    (None, "required", "tool_choice", "needs tools"),
    (TOOLS, "sometimes", "tool_choice", "'sometimes'"),
    (TOOLS, {"function": {"name": "get_time"}}, "tool_choice", "named tool_choice"),
    ([{"type": "function"}], "auto", "tools", "tools[0]"),
  ]:
    with pytest.raises(ToolChoiceError, match=re.escape(words)) as error:
      effective_tool_choice(tools, choice)
    assert error.value.param == param
  body = ChatCompletionRequest(messages=[], tools=TOOLS, tool_choice="required",
                               structured_outputs={"regex": "a"})  # fmt: skip
  with pytest.raises(RequestError, match="cannot be combined") as error:
    body.sampling_params()
  assert error.value.param == "tool_choice"
  no_auto = ChatParserOptions.from_names(False, "hermes", None)
  with pytest.raises(RequestError, match="--enable-auto-tool-choice") as error:
    no_auto.output_parser(TOOLS, "auto")
  assert error.value.param == "tool_choice"


def test_the_chat_template_gets_the_tools_and_the_tool_call_messages():
  template = (
    "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
    "{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<{{ c.function.name }} {{ c.function.arguments.city }}>"
    "{% endfor %}|{% endfor %}"
  )
  messages = [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "1", "content": "sunny"},
  ]  # fmt: skip
  (prompt,) = render_prompts(chatml_byte_tokenizer(), as_conversations(messages), tools=TOOLS,
                             chat_template=template, add_generation_prompt=False)  # fmt: skip
  expected = "[get_weather][get_time]user:Weather?|assistant:<get_weather Paris>|tool:sunny|"
  assert prompt["prompt"] == expected
  with pytest.raises(ValueError, match=r"message 0: tool_calls\[0\]\.function\.arguments"):
    as_conversations([{"role": "assistant", "tool_calls": [{"function": {"name": "f",
                       "arguments": "{oops"}}]}])  # fmt: skip


def test_unknown_parsers_are_refused_when_the_server_starts(monkeypatch, capsys):
  def no_load(args):
    raise AssertionError("the model must not load")

  monkeypatch.setattr(serve, "load_engine", no_load)
  for flag, known in (("--tool-call-parser", TOOL_PARSERS), ("--reasoning-parser",
                                                              REASONING_PARSERS)):  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
      cli.main(["serve", flag, "nope"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: invalid choice: 'nope'" in err and all(k in err for k in known)
  assert cli.main(["serve", "--enable-auto-tool-choice"]) == 2
  assert "needs --tool-call-parser" in capsys.readouterr().out
  for kwargs, words in [
    ({"tool_call_parser": "nope"}, "unknown tool_call_parser 'nope': the known ones are "
     "['hermes', 'llama3_json', 'qwen3_coder']"),
    ({"reasoning_parser": "nope"}, "unknown reasoning_parser 'nope': the known ones are "
     "['deepseek_r1', 'qwen3']"),
  ]:  # fmt: skip
    with pytest.raises(ValueError, match=re.escape(words)):
      build_app(None, "m", **kwargs)  # type: ignore[arg-type]
