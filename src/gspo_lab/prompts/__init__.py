"""The prompt axis: how an example becomes model input (the `prompt` config group).

`PromptFormat(template, system, chat_template, chat_template_kwargs)`: the template fills in the example's
columns (`{prompt}` and any other, e.g. `{question}`); the tokenizer's chat template then wraps it as one
user message after an optional system message and adds the generation prompt
(`apply_chat_template(..., add_generation_prompt=True, **chat_template_kwargs)`, e.g. `enable_thinking`).

`chat_template: auto` (the default) applies it when the tokenizer has one. A plain-text prompt then becomes a
user message, as open-r1 does, because a chat model given raw text answers off its training distribution; TRL
tokenizes plain text as it is, which is `prompt.chat_template=false`. Conversational data (a prompt that is a
list of messages) always goes through the chat template. The built-in tasks' tokenizers have no chat template,
so their prompts reach the model exactly as before.

>>> from gspo_lab.tasks.base import Example
>>> PromptFormat(template="Q: {prompt}\\nA:").bind(None).text(Example("1+1=", "2"))
'Q: 1+1=\\nA:'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gspo_lab.tasks.base import Example

CHAT_TEMPLATE = ("auto", True, False)
DEFAULT_TEMPLATE = "{prompt}"  # the example's prompt as it is


@dataclass(frozen=True)
class PromptFormat:
    """Settings of the prompt group; `bind(tokenizer)` gives the Renderer that formats examples for it."""

    template: str = DEFAULT_TEMPLATE
    system: str | None = None
    chat_template: bool | str = "auto"
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.chat_template not in CHAT_TEMPLATE:
            raise ValueError(f"prompt.chat_template={self.chat_template!r} must be auto, true or false")
        if not isinstance(self.template, str) or "{" not in self.template:
            raise ValueError(f"prompt.template={self.template!r} must be a string naming a column, e.g. '{{prompt}}'")
        object.__setattr__(self, "chat_template_kwargs", dict(self.chat_template_kwargs or {}))

    def bind(self, tokenizer) -> Renderer:
        has_template = bool(getattr(tokenizer, "chat_template", None))
        chat = has_template if self.chat_template == "auto" else self.chat_template
        if chat and not has_template:
            raise ValueError(f"prompt.chat_template=true but the tokenizer ({type(tokenizer).__name__}) has no chat "
                             "template; set prompt.chat_template=false or use a chat model's tokenizer")
        if self.system is not None and not chat:
            raise ValueError("prompt.system is set but no chat template applies (prompt.chat_template="
                             f"{self.chat_template}, the tokenizer has {'one' if has_template else 'none'}); write the "
                             "instruction into prompt.template instead")
        return Renderer(self, tokenizer, bool(chat))


@dataclass(frozen=True)
class Renderer:
    """A PromptFormat bound to a tokenizer. `add_special_tokens` is what tokenizing the rendered text takes:
    False after a chat template, whose text holds its own special tokens."""

    format: PromptFormat
    tokenizer: Any
    chat: bool

    @property
    def add_special_tokens(self) -> bool:
        return not self.chat

    def text(self, example: Example, observation: str | None = None, tools: list[dict] | None = None) -> str:
        """The model input of `example`. Multi-turn (gspo_lab.rollout.multi_turn): `observation`, what an
        environment's reset returned, extends the last user message (TRL's rule); `tools`, their JSON schemas,
        go to the chat template."""
        if isinstance(example.prompt, list):
            if not self.chat:
                raise ValueError("the data's prompts are chat messages, but no chat template applies (prompt."
                                 f"chat_template={self.format.chat_template}); use a tokenizer with a chat template")
            if self.format.template != DEFAULT_TEMPLATE:
                raise ValueError(f"prompt.template={self.format.template!r} would be ignored: the data's prompts are "
                                 "chat messages, which go to the chat template as they are; keep prompt.template="
                                 f"'{DEFAULT_TEMPLATE}' and give an instruction with prompt.system")
            messages = list(example.prompt)
        else:
            columns = {**example.meta, "prompt": example.prompt}
            try:
                content = self.format.template.format(**columns)
            except KeyError as error:
                raise ValueError(f"prompt.template={self.format.template!r} names the column {error.args[0]!r}; the "
                                 f"example has {sorted(columns)}") from None
            if not self.chat:
                return content + (observation or "")
            messages = [{"role": "user", "content": content}]
        if observation is not None:
            messages[-1] = {**messages[-1], "content": messages[-1]["content"] + observation}
        if self.format.system is not None and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": self.format.system}] + messages
        extra = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra,
                                                  **self.format.chat_template_kwargs)

    def texts(self, examples: list[Example], tools: list[dict] | None = None) -> list[str]:
        return [self.text(example, tools=tools) for example in examples]
