"""Token-exact multi-turn prompts: the conversation is never re-tokenised.

The prompt of turn t+1 is the prompt of turn t, then the output ids vLLM
sampled at turn t, then the tokens that close the assistant's turn and add the
new user message, rendered through the chat template as a *delta*:

- the delta is the chat template's text for a fixed dummy conversation with
  the new message, after the dummy assistant turn's content and its end as
  the conversation without the message renders them (so system-prompt
  injection, role headers and separators are the template's own; a template
  that renders a last assistant turn otherwise before its content, as Qwen3's
  empty think block, still gives one);
- the end of an assistant turn ("<|im_end|>\\n" for ChatML) is taken from the
  template too. When the output stopped on an end-of-turn special token, vLLM
  sampled that token already and only the rest ("\\n") is appended; after a
  stop string, or any other stop, the whole end of turn is appended.

Re-tokenising the whole conversation instead can merge tokens across the
turn boundary, drop the newline after the end-of-turn token, or (Qwen3)
strip earlier `<think>` blocks: the trainer would then score ids the model
never saw. Every call records whether its prompt extends the previous prompt
+ output exactly (`LLMCall.extends_previous`).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

_MARK = "ZQXJ7"  # a dummy assistant text that no template contains
# The date a template writes into its prompts (Llama 3's "Today Date:" is today's unless given): fixed, so that an
# episode's prompts do not depend on the day it is played, replayed or forked. Llama 3's own default.
TEMPLATE_DATE = "26 Jul 2024"


class ChatTokens:
    """Renders first prompts and turn deltas with one tokenizer's chat template."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def _template(self, messages: list[dict[str, Any]], add_generation_prompt: bool, **template: Any) -> str:
        template.setdefault("date_string", TEMPLATE_DATE)
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **template
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def first_prompt(self, messages: list[dict[str, Any]], **template: Any) -> tuple[str, list[int]]:
        """The whole first prompt (chat template + generation prompt) as text and ids; `template`: more of the
        template's arguments (tools)."""
        text = self._template(messages, add_generation_prompt=True, **template)
        return text, self.encode(text)

    @cached_property
    def _dummy(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": "A"}, {"role": "assistant", "content": _MARK}]

    @cached_property
    def turn_end(self) -> str:
        """What the template writes after an assistant message's content ("<|im_end|>\\n" for ChatML)."""
        text = self._template(self._dummy, add_generation_prompt=False)
        at = text.rfind(_MARK)
        if at < 0:
            raise ValueError("the chat template does not render an assistant message's content")
        return text[at + len(_MARK) :]

    def user_delta(self, content: str) -> str:
        """The template's text for one more user message and the generation prompt, after a closed assistant turn."""
        return self.messages_delta([{"role": "user", "content": content}])

    def messages_delta(
        self, messages: list[dict[str, Any]], tool_calls: list[dict[str, Any]] | None = None, **template: Any
    ) -> str:
        """The template's text for `messages` (user, tool or system ones) and the generation prompt, after a
        closed assistant turn; `tool_calls`: the calls that turn made (a template may render tool results by
        them); `template`: more of the template's arguments (tools)."""
        assistant: dict[str, Any] = {"role": "assistant", "content": _MARK}
        if tool_calls:
            assistant["tool_calls"] = tool_calls
        dummy = [self._dummy[0], assistant]
        base = self._template(dummy, add_generation_prompt=False, **template)
        full = self._template([*dummy, *messages], add_generation_prompt=True, **template)
        if full.startswith(base):  # the conversation renders the same with the messages added
            return full[len(base) :]
        # Else what follows the assistant's content (its tool calls, the end of its turn) must render the same once
        # messages follow it. What precedes the content may not (Qwen3 writes an empty think block into an
        # assistant turn only while it is the last message) and is never rendered again: the sampled ids stand
        # for it.
        at_base, at_full = base.find(_MARK), full.find(_MARK)
        tail = base[at_base + len(_MARK) :]
        if at_base < 0 or at_full < 0 or not full[at_full + len(_MARK) :].startswith(tail):
            raise ValueError(
                "the chat template renders an assistant turn's end differently once a message is added; "
                "a token-exact delta cannot be taken from it"
            )
        return full[at_full + len(_MARK) + len(tail) :]

    def close_turn(self, output_ids: list[int]) -> str:
        """What closes an assistant turn after its sampled `output_ids`: the template's end of turn, less the
        end-of-turn token when vLLM sampled it itself."""
        end = self.turn_end
        if output_ids and output_ids[-1] in set(self.tokenizer.all_special_ids):
            sampled = self.tokenizer.decode([output_ids[-1]], skip_special_tokens=False)
            if sampled and end.startswith(sampled):
                end = end[len(sampled) :]  # vLLM sampled the end-of-turn token itself
        return end

    def continuation(self, output_ids: list[int], observation: str) -> tuple[str, list[int]]:
        """Text and ids to append after a turn's sampled `output_ids` so that the model reads `observation`
        as the next user message and starts its answer."""
        text = self.close_turn(output_ids) + self.user_delta(observation)
        return text, self.encode(text)
