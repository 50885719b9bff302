"""Tools in chat messages: how a model is told about them and how its calls are read back.

Tool calls are read from the sampled text by vLLM's own tool parsers (`vllm.tool_parsers`, the ones its chat
endpoint uses with `--tool-call-parser NAME`; `hermes` by default), so a program sees the calls exactly as
vLLM's OpenAI server would return them.

A chat template that renders `tools` (Qwen, Llama 3.x, Hermes...) is given them. One that does not (the
embedded SmolLM2's ChatML template ignores them, and drops an assistant message's `tool_calls`) gets the
Hermes format written in for it:

- the tools' signatures go into the system message (a new first message when there is none), with the
  format of a call: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- an earlier assistant message's `tool_calls` are written into its content in that format;
- sampling stops after `</tool_call>` (the stop string stays in the output), one call per turn.

Only full renders use this: a call that extends the previous one appends the ids sampled, never a rendering.
"""

from __future__ import annotations

import json
import logging
from functools import cached_property
from typing import Any

DEFAULT_PARSER = "hermes"
_CALL_START, _CALL_END = "<tool_call>", "</tool_call>"
_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "zqxj_probe", "description": "probe", "parameters": {"type": "object", "properties": {}}},
}


class ToolFormatError(ValueError):
    """Tool definitions or tool messages the gateway cannot use (the caller's fault: HTTP 400)."""


def parser_names() -> list[str]:
    """vLLM's tool parsers, by the names `--tool-call-parser` takes."""
    from vllm.tool_parsers import ToolParserManager

    return sorted(ToolParserManager.list_registered())


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI tool definitions, checked: a list of {"type": "function", "function": {"name", "parameters"?}}."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolFormatError("tools: expected a list of tool definitions")
    names = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ToolFormatError(f'tools[{i}]: expected {{"type": "function", "function": {{...}}}}')
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not name or not name.replace("_", "a").replace("-", "a").isalnum():
            raise ToolFormatError(f"tools[{i}].function.name: expected a name of letters, digits, _ and -")
        if name in names:
            raise ToolFormatError(f"tools[{i}].function.name: {name!r} is defined twice")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and (
            not isinstance(parameters, dict) or parameters.get("type", "object") != "object"
        ):
            raise ToolFormatError(f"tools[{i}].function.parameters: expected a JSON schema of type object")
    return tools


def _arguments(call: dict[str, Any]) -> Any:
    arguments = call.get("function", {}).get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def same_calls(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Two lists of OpenAI tool calls name the same functions with the same arguments (JSON compared as
    values: a client may write the arguments back with other spacing; ids are not compared)."""
    return len(a) == len(b) and all(
        x.get("function", {}).get("name") == y.get("function", {}).get("name") and _arguments(x) == _arguments(y)
        for x, y in zip(a, b)
    )


class ToolFormat:
    """One tokenizer's chat template and one of vLLM's tool parsers."""

    def __init__(self, tokenizer: Any, parser: str = DEFAULT_PARSER):
        self.tokenizer = tokenizer
        self.parser_name = parser

    @cached_property
    def _parser_class(self):
        from vllm.tool_parsers import ToolParserManager

        try:
            parser = ToolParserManager.get_tool_parser(self.parser_name)
        except KeyError:
            raise ToolFormatError(
                f"unknown tool parser {self.parser_name!r} (vLLM's: {', '.join(parser_names())})"
            ) from None
        # a malformed call is text to the program (no tool call), not a traceback in the run's log
        logging.getLogger(parser.__module__).setLevel(logging.CRITICAL)
        return parser

    def _render(self, messages: list[dict[str, Any]], **template: Any) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, **template)

    @cached_property
    def renders_tools(self) -> bool:
        """Does the chat template write the tools it is given?"""
        plain = [{"role": "user", "content": "A"}]
        try:
            return self._render(plain, tools=[_PROBE_TOOL]) != self._render(plain)
        except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
            return False

    @cached_property
    def renders_tool_calls(self) -> bool:
        """Does it write an assistant message's tool calls?"""
        call = {"id": "c0", "type": "function", "function": {"name": "zqxj_probe", "arguments": "{}"}}
        messages = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        try:
            return "zqxj_probe" in self._render(messages, tools=[_PROBE_TOOL])
        except Exception:  # noqa: BLE001
            return False

    def stop(self, tools: list[dict[str, Any]]) -> list[str]:
        """Stop strings a call with `tools` adds: the end of a call, where the format is ours."""
        return [_CALL_END] if tools and not self.renders_tools else []

    def template_kwargs(self, tools: list[dict[str, Any]]) -> dict[str, Any]:
        return {"tools": tools} if tools and self.renders_tools else {}

    def prepare(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages a full render is given: with the tools and earlier calls written in where the
        template would not write them."""
        out = [dict(m) for m in messages]
        if not self.renders_tool_calls:
            for message in out:
                calls = message.get("tool_calls")
                if message.get("role") == "assistant" and calls:
                    message["content"] = written(message)
                    del message["tool_calls"]
        if tools and not self.renders_tools:  # written in by us, in the Hermes format
            preamble = _hermes_preamble(tools)
            if out and out[0].get("role") == "system":
                out[0]["content"] = f"{out[0].get('content') or ''}\n\n{preamble}".lstrip()
            else:
                out.insert(0, {"role": "system", "content": preamble})
        return out

    def parse(self, text: str, tools: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls in the OpenAI format) of a sampled text, by vLLM's parser."""
        if not tools:
            return text, []
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest(model="-", messages=[{"role": "user", "content": "-"}], tools=tools)
        parsed = self._parser_class(self.tokenizer, request.tools).extract_tool_calls(text, request)
        if not parsed.tools_called:
            return text, []
        calls = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in parsed.tool_calls
        ]
        return parsed.content, calls


def written(message: dict[str, Any]) -> str:
    """A message's text with its tool calls written in (the Hermes format)."""
    calls = "\n".join(_written_call(c) for c in message.get("tool_calls") or [])
    text = message.get("content") or ""
    return f"{text}\n{calls}" if text and calls else text or calls


def _written_call(call: dict[str, Any]) -> str:
    function = call.get("function", {})
    body = {"name": function.get("name"), "arguments": _arguments(call)}
    return f"{_CALL_START}\n{json.dumps(body, ensure_ascii=False)}\n{_CALL_END}"


def _hermes_preamble(tools: list[dict[str, Any]]) -> str:
    signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{signatures}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        f'{_CALL_START}{_CALL_END} XML tags:\n{_CALL_START}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{_CALL_END}'
    )
