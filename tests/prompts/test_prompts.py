"""The prompt axis: template, system message and the tokenizer's chat template."""

import pytest

from gspo_lab.models.builders import load_pretrained
from gspo_lab.prompts import PromptFormat
from gspo_lab.tasks import Example
from tests.chat_model import save_chat_model

EXAMPLE = Example("Tom has 3 apples.", "3", meta={"level": 0})


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    return load_pretrained(save_chat_model(tmp_path_factory.mktemp("chat")))[1]


def test_a_chat_tokenizer_gets_chatml_with_the_system_message_and_the_generation_prompt(chat_tokenizer):
    renderer = PromptFormat(template="Q: {prompt} (level {level})", system="Be brief.").bind(chat_tokenizer)
    assert renderer.text(EXAMPLE) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ: Tom has 3 apples. "
                                      "(level 0)<|im_end|>\n<|im_start|>assistant\n")
    assert renderer.add_special_tokens is False


def test_chat_template_kwargs_reach_the_template(chat_tokenizer):
    renderer = PromptFormat(chat_template_kwargs={"enable_thinking": False}).bind(chat_tokenizer)
    assert renderer.text(EXAMPLE).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_chat_template_false_gives_the_text_as_it_is_as_trl_does(chat_tokenizer):
    renderer = PromptFormat(chat_template=False).bind(chat_tokenizer)
    assert renderer.text(EXAMPLE) == "Tom has 3 apples." and renderer.add_special_tokens


def test_conversational_prompts_go_through_the_template_unchanged(chat_tokenizer):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    text = PromptFormat(system="ignored: the data has one").bind(chat_tokenizer).text(Example(messages, "1"))
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"


def test_settings_that_cannot_apply_are_refused(chat_tokenizer):
    from gspo_lab.models.tokenizer import char_tokenizer

    with pytest.raises(ValueError, match="prompt.chat_template=true but the tokenizer"):
        PromptFormat(chat_template=True).bind(char_tokenizer())
    with pytest.raises(ValueError, match="prompt.system is set but no chat template applies"):
        PromptFormat(system="S").bind(char_tokenizer())
    with pytest.raises(ValueError, match=r"names the column 'question'; the example has \['level', 'prompt'\]"):
        PromptFormat(template="{question}").bind(chat_tokenizer).text(EXAMPLE)
    with pytest.raises(ValueError, match="prompt.chat_template='sometimes' must be auto, true or false"):
        PromptFormat(chat_template="sometimes")
    # a template fills in text prompts; chat messages reach the chat template as they are, so it would be lost
    with pytest.raises(ValueError, match=r"prompt.template='\{prompt\} Think step by step.' would be ignored: the "
                                         r"data's prompts are chat messages"):
        PromptFormat(template="{prompt} Think step by step.").bind(chat_tokenizer).text(
            Example([{"role": "user", "content": "U"}], "1"))
