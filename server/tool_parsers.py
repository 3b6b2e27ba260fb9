"""Tool calls in the model's own format, for `tool_choice: "auto"`.

With `auto` the model decides between answering in text and calling tools, in the format its chat
template taught it; a parser reads the calls back out of the generated text (vLLM's
`--tool-call-parser`). Nothing constrains the generation, so every drafter gives plain decoding's
text and calls. A forced call (`required`, a named function) goes through a grammar instead
(docs/structured-output.md).

    hermes    <tool_call>{"name": "f", "arguments": {...}}</tool_call>, one block per call, text
              around them the message's content (Hermes 2 Pro, Qwen2.5/Qwen3, and templates that
              follow them).

`--tool-call-parser auto` (the default) picks the parser whose marker the chat template contains,
and only when the template renders the tools it is given; otherwise `tool_choice: "auto"` is a 400
that says why.
"""

from __future__ import annotations

import json
import logging
import re

logger = logging.getLogger("specserve")

TOOL_CALL_PARSERS = ("auto", "hermes", "none")


class HermesParser:
    """`<tool_call>` JSON `</tool_call>` blocks, each {"name": str, "arguments": object}."""

    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    @classmethod
    def detect(cls, template: str) -> bool:
        return cls.start in template

    def parse(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        """(content, calls) of a whole answer: calls as (name, arguments as JSON text), content the
        text outside the blocks (None when blank). A block that is not such a call (cut by
        max_tokens, or not JSON) leaves the whole answer as content, with no calls."""
        if self.start not in text:
            return text, []
        calls = []
        for body in self._block.findall(text):
            try:
                value = json.loads(body)
                name, args = value["name"], value.get("arguments", {})
            except (ValueError, KeyError, TypeError):
                return text, []
            if not isinstance(name, str) or not isinstance(args, dict):
                return text, []
            calls.append((name, json.dumps(args, ensure_ascii=False)))
        content = self._block.sub("", text).strip()
        return content or None, calls

    def streamable(self, text: str) -> int:
        """How much of `text` (an answer so far) may be streamed as content: all of it up to a call's
        marker, or up to a tail that could still become one."""
        at = text.find(self.start)
        if at >= 0:
            return at
        for k in range(min(len(self.start) - 1, len(text)), 0, -1):
            if text.endswith(self.start[:k]):
                return len(text) - k
        return len(text)


PARSERS = {"hermes": HermesParser}


def renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template puts the tools it is given into the prompt."""
    messages = [{"role": "user", "content": "x"}]
    tool = {"type": "function", "function": {"name": "specserve_probe_fn", "description": "d",
                                             "parameters": {"type": "object", "properties": {}}}}
    try:
        with_tools = tokenizer.apply_chat_template(messages, tools=[tool], add_generation_prompt=True, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that fails with tools does not render them
        return False
    return "specserve_probe_fn" in with_tools


def tool_call_parser(tokenizer, setting: str = "auto"):
    """The parser for `tool_choice: "auto"` (None: such requests are refused), from the setting and
    the tokenizer's chat template. Returns (parser or None, why not: a sentence for the 400)."""
    if setting not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {setting!r}")
    template = getattr(tokenizer, "chat_template", None)
    if setting == "none":
        return None, "this server runs with --tool-call-parser none"
    if not isinstance(template, str) or not renders_tools(tokenizer):
        return None, "this model's chat template does not render tools"
    cls = PARSERS.get(setting) or next((c for c in PARSERS.values() if c.detect(template)), None)
    if cls is None:
        return None, ("no tool-call parser knows this model's chat template (start the server with "
                      f"--tool-call-parser one of {sorted(PARSERS)})")
    return cls(), None
