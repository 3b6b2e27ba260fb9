"""server/tool_parsers.py: the hermes parser reads calls and content out of an answer, leaves an
answer whose call is not one (cut, not JSON) as content, and tells how much of a partial answer may
stream; `tool_call_parser` picks it from a chat template that renders tools, and says why not
otherwise."""

from __future__ import annotations

import json

import pytest
import transformers

from specserve.server.tool_parsers import HermesParser, renders_tools, tool_call_parser

CALL = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'


def test_hermes_reads_calls_and_the_content_around_them():
    p = HermesParser()
    assert p.parse("just text") == ("just text", [])
    assert p.parse(CALL) == (None, [("f", '{"x": 1}')])
    content, calls = p.parse("Sure.\n" + CALL + "\n" + CALL.replace('"f"', '"g"') + "\n")
    assert content == "Sure." and [n for n, _ in calls] == ["f", "g"] and json.loads(calls[1][1]) == {"x": 1}
    # the model stopped right after the JSON, before the closing tag
    assert p.parse('<tool_call>{"name": "f", "arguments": {}}') == (None, [("f", "{}")])


@pytest.mark.parametrize("bad", ['<tool_call>{"name": "f", "argu', "<tool_call>not json</tool_call>",
                                 '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"name": 3}</tool_call>'])
def test_hermes_leaves_a_broken_call_as_content(bad):
    assert HermesParser().parse("a " + bad) == ("a " + bad, [])


def test_hermes_streams_up_to_the_marker_or_a_tail_that_could_become_one():
    p = HermesParser()
    assert p.streamable("plain text") == len("plain text")
    assert p.streamable("Sure. <tool_call>{") == len("Sure. ")
    assert p.streamable("Sure. <tool_") == len("Sure. ")
    assert p.streamable("a < b") == len("a < b")


def _tokenizer(template):
    from tokenizers import Tokenizer, models

    return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, "<unk>")),
                                                unk_token="<unk>", chat_template=template)


def test_the_parser_comes_from_a_template_that_renders_tools():
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tools = "{% for t in tools or [] %}{{ t['function']['name'] }}{% endfor %}<tool_call>" + plain
    assert not renders_tools(_tokenizer(plain)) and renders_tools(_tokenizer(tools))
    parser, why = tool_call_parser(_tokenizer(tools))
    assert isinstance(parser, HermesParser) and why is None
    assert tool_call_parser(_tokenizer(plain)) == (None, "this model's chat template does not render tools")
    assert tool_call_parser(_tokenizer(tools), "none")[0] is None
    # a template that renders tools in a format no parser knows: only an explicit choice serves it
    other = tools.replace("<tool_call>", "[CALLS]")
    parser, why = tool_call_parser(_tokenizer(other))
    assert parser is None and "--tool-call-parser" in why
    assert isinstance(tool_call_parser(_tokenizer(other), "hermes")[0], HermesParser)
    with pytest.raises(ValueError):
        tool_call_parser(_tokenizer(tools), "mistral")
