"""Chat templates against transformers' `apply_chat_template` on the same tokenizer.json: found where transformers
finds them, rendered under its rules, tokenized with special-token text mapped to ids; and `model.chat`."""

from __future__ import annotations

import json

import pytest

from moe import MoEModel
from moe.chat.template import NoChatTemplate
from tests.checkpoints import tiny_config, write_checkpoint

SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "[INST]", "[/INST]"]

# Mixtral-8x7B-Instruct's template, as its tokenizer_config.json ships it
MIXTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
           "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")

# ChatML with whitespace control, a thinking switch, tools through tojson, and blocks on their own lines (trim_blocks
# and lstrip_blocks decide what those lines leave)
CHATML = """{%- if tools %}
<|im_start|>system
Tools: {{ tools | tojson }}<|im_end|>
{% endif %}
{% for message in messages %}
    {% if message.role == 'system' and loop.first %}
<|im_start|>system
{{ message.content }}<|im_end|>
    {% else %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
    {% endif %}
{% endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}
{%- endif %}
"""

CONVERSATION = [{"role": "system", "content": "Be brief. Café & <b>"}, {"role": "user", "content": "Who is Emma?"},
                {"role": "assistant", "content": "A young woman."}, {"role": "user", "content": "And Mr Knightley?"}]
TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune Emma " * 30


def tokenizer_dir(directory, template_config=None, jinja=None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": False}
    if template_config is not None:
        config["chat_template"] = template_config
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (directory / "chat_template.jinja").write_text(jinja)
    return directory


def checkpoint(tmp_path, **kw):
    return tokenizer_dir(write_checkpoint(tmp_path / "ckpt", tiny_config(vocab_size=300)), **kw)


def both(path):
    transformers = pytest.importorskip("transformers")
    return MoEModel.from_pretrained(path), transformers.AutoTokenizer.from_pretrained(path)


CASES = {"mixtral": (MIXTRAL, CONVERSATION[1:], {}), "chatml": (CHATML, CONVERSATION, {}),
         "chatml-no-thinking": (CHATML, CONVERSATION, {"enable_thinking": False}),
         "chatml-tools": (CHATML, CONVERSATION, {"tools": [{"type": "function", "function": {"name": "ö"}}]})}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_text_and_ids_equal_transformers(tmp_path, case, generation_prompt):
    template, messages, extra = CASES[case]
    ours, theirs = both(checkpoint(tmp_path, template_config=template))
    kw = dict(add_generation_prompt=generation_prompt, **extra)
    text = ours.tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    assert text == theirs.apply_chat_template(messages, tokenize=False, **kw)
    assert ours.tokenizer.apply_chat_template(messages, **kw) == dict(theirs.apply_chat_template(messages, **kw))
    ids = ours.tokenizer.apply_chat_template(messages, return_dict=False, **kw)
    assert ids == theirs.apply_chat_template(messages, return_dict=False, **kw)
    specials = {theirs.convert_tokens_to_ids(t) for t in SPECIAL}
    assert specials & set(ids)  # special-token text became its id
    batch = [messages, messages[:2]]
    assert (ours.tokenizer.apply_chat_template(batch, tokenize=False, **kw)
            == theirs.apply_chat_template(batch, tokenize=False, **kw))


def test_chat_template_jinja_comes_before_tokenizer_config(tmp_path):
    ours, theirs = both(checkpoint(tmp_path, template_config=MIXTRAL, jinja=CHATML))
    text = ours.tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert text.startswith("<|im_start|>system") and text == theirs.apply_chat_template(CONVERSATION, tokenize=False)


def test_named_templates_take_default_unless_named(tmp_path):
    named = [{"name": "default", "template": MIXTRAL}, {"name": "tool_use", "template": CHATML}]
    ours, theirs = both(checkpoint(tmp_path, template_config=named))
    for name in (None, "tool_use"):
        assert (ours.tokenizer.apply_chat_template(CONVERSATION[1:], tokenize=False, chat_template=name)
                == theirs.apply_chat_template(CONVERSATION[1:], tokenize=False, chat_template=name))


def test_the_templates_own_refusal_is_one_line(tmp_path):
    model = MoEModel.from_pretrained(checkpoint(tmp_path, template_config=MIXTRAL))
    with pytest.raises(ValueError, match="roles must alternate"):
        model.tokenizer.apply_chat_template([{"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError, match="message 0 must be a dict"):
        model.chat(["hello"])


def test_a_checkpoint_without_a_template_says_how_to_give_one(tmp_path):
    model = MoEModel.from_pretrained(checkpoint(tmp_path))
    with pytest.raises(NoChatTemplate, match="--chat-template FILE"):
        model.chat([{"role": "user", "content": "hi"}])


def test_the_sandbox_refuses_what_templates_must_not_do(tmp_path):
    evil = "{{ messages.__class__.__mro__ }}"
    model = MoEModel.from_pretrained(checkpoint(tmp_path, template_config=evil))
    with pytest.raises(ValueError, match="chat template"):
        model.tokenizer.apply_chat_template(CONVERSATION, tokenize=False)


def steer_towards(path, token: int, like: int) -> None:
    """Make `token` the head's choice wherever `like` was a positive choice: its head row twice `like`'s."""
    from safetensors.torch import load_file, save_file

    for f in path.glob("*.safetensors"):
        tensors = load_file(f)
        if "lm_head.weight" in tensors:
            tensors["lm_head.weight"][token] = 2 * tensors["lm_head.weight"][like]
            save_file(tensors, f, metadata={"format": "pt"})


@pytest.mark.parametrize("template, turn_end", [(CHATML, "<|im_end|>"), (MIXTRAL, "</s>")], ids=["chatml", "mixtral"])
def test_chat_replies_stop_at_the_templates_end_of_turn(tmp_path, template, turn_end):
    path = checkpoint(tmp_path, template_config=template)
    messages = CONVERSATION[1:2]
    with MoEModel.from_pretrained(path) as model:
        end = model.tokenizer.encode_special(turn_end)[0]
        prompt = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        free = model.generate([prompt], max_new_tokens=12, ignore_eos=True, temperature=0)[0]
    steer_towards(path, end, free.token_ids[6])
    with MoEModel.from_pretrained(path) as model:
        free = model.generate([prompt], max_new_tokens=12, ignore_eos=True, temperature=0)[0]
        assert end in free.token_ids  # the steered model writes the end of its turn
        reply = model.chat(messages, max_new_tokens=12, temperature=0)
        assert reply.token_ids == free.token_ids[:free.token_ids.index(end)] and reply.finish_reason == "stop"
        assert isinstance(reply, str) and reply == model.tokenizer.decode_continuation(prompt, reply.token_ids)
        assert model.chat([messages, CONVERSATION[1:4]], max_new_tokens=12, temperature=0)[0] == reply


def test_generation_tags_and_strftime_render_as_in_transformers(tmp_path):
    template = ("{{ strftime_now('%Y') }}|{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
                "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}|{% endfor %}")
    ours, theirs = both(checkpoint(tmp_path, template_config=template))
    messages = CONVERSATION[1:3]
    assert (ours.tokenizer.apply_chat_template(messages, tokenize=False)
            == theirs.apply_chat_template(messages, tokenize=False))


# Content as Qwen's templates read it: a string, or OpenAI's list of parts looped over
PARTS_LOOP = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}"
              "{% else %}{% for part in m['content'] %}[{{ part.text }}]{% endfor %}{% endif %}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_content_parts_are_joined_for_a_template_of_strings_and_kept_for_one_that_loops_over_them():
    """What vLLM's server does with OpenAI's content parts (its "string" and "openai" content formats)."""
    from moe.chat.template import takes_content_parts, text_content

    parts = [{"role": "user", "content": [{"type": "text", "text": "Who is"}, {"type": "text", "text": "Emma?"}]}]
    assert not takes_content_parts(CHATML) and takes_content_parts(PARTS_LOOP)
    assert text_content(parts, CHATML) == [{"role": "user", "content": "Who is\nEmma?"}]
    assert text_content(parts, PARTS_LOOP) == parts
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match="message 0: a content part of type 'image_url' is not supported"):
        text_content(image, CHATML)


# An agent template in the manner of recent Qwen ones (written here): a macro over content parts, a namespace found
# walking the messages backwards, tool calls with arguments as a mapping, tool results grouped with previtem and
# nextitem, thinking split off the assistant's content
AGENT = """{%- macro text_of(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable and content is not mapping -%}{% for part in content %}{{ part.text }}{% endfor %}
{%- elif content is none -%}
{%- else -%}{{ raise_exception('content must be text or parts') }}{%- endif -%}
{%- endmacro -%}
{%- if tools -%}<|im_start|>system
Tools:{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
{% if messages[0].role == 'system' %}{{ text_of(messages[0].content) | trim }}{% endif %}<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ text_of(messages[0].content) | trim }}<|im_end|>
{% endif -%}
{%- set ns = namespace(last_user=messages | length - 1) -%}
{%- for m in messages[::-1] -%}
{%- if m.role == 'user' -%}{%- set ns.last_user = (messages | length - 1) - loop.index0 -%}{%- break -%}{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
{%- set content = text_of(m.content) | trim -%}
{%- if m.role == 'system' -%}{% if not loop.first %}{{ raise_exception('system comes first') }}{% endif %}
{%- elif m.role == 'user' -%}<|im_start|>user
{{ content }}<|im_end|>
{% elif m.role == 'assistant' -%}
{%- set thought = m.reasoning_content if m.reasoning_content is string else '' -%}
{%- if '</think>' in content -%}
{%- set thought = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}
{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
{%- endif -%}
<|im_start|>assistant
{% if loop.index0 > ns.last_user %}<think>
{{ thought | trim }}
</think>

{% endif %}{{ content }}
{%- for call in m.tool_calls or [] -%}
{%- set call = call.function if call.function is defined else call -%}
<tool_call name="{{ call.name }}">{% for key, value in call.arguments | items %}
<arg name="{{ key }}">{{ value | tojson if value is mapping or (value is sequence and value is not string)
else value }}</arg>
{%- endfor %}</tool_call>
{%- endfor -%}
<|im_end|>
{% elif m.role == 'tool' -%}
{%- if loop.previtem and loop.previtem.role != 'tool' %}<|im_start|>user{% endif %}
<result>{{ content }}</result>
{%- if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>
{% endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

AGENT_CONVERSATION = [
    {"role": "system", "content": "  Be brief.  "},
    {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
    {"role": "assistant", "content": "<think>\nlook it up\n</think>\n\nLet me check.",
     "tool_calls": [{"type": "function", "function": {"name": "weather",
                                                      "arguments": {"city": "Paris", "days": [1, 2], "unit": "C"}}}]},
    {"role": "tool", "content": "18 C"}, {"role": "tool", "content": "rain"},
    {"role": "assistant", "content": "18 C and rain.", "reasoning_content": "two results"},
    {"role": "user", "content": "Thanks"}]


@pytest.mark.parametrize("extra", [{}, {"enable_thinking": False},
                                   {"tools": [{"type": "function", "function": {"name": "weather"}}]}],
                         ids=["plain", "no-thinking", "tools"])
def test_an_agent_template_with_tool_calls_and_results_renders_as_in_transformers(tmp_path, extra):
    ours, theirs = both(checkpoint(tmp_path, template_config=AGENT))
    for messages in (AGENT_CONVERSATION, AGENT_CONVERSATION[:5]):
        kw = dict(add_generation_prompt=True, **extra)
        text = ours.tokenizer.apply_chat_template(messages, tokenize=False, **kw)
        assert text == theirs.apply_chat_template(messages, tokenize=False, **kw)
        assert ours.tokenizer.apply_chat_template(messages, return_dict=False, **kw) == \
            theirs.apply_chat_template(messages, return_dict=False, **kw)
    assert '<arg name="days">[1, 2]</arg>' in text and "<result>18 C</result><result>rain</result><|im_end|>" in text


TRIMMED = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}"
PARTS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% for p in m.content %}{{ p.text }}|{% endfor %}"
         "<|im_end|>\n{% endfor %}")
ASKED = CONVERSATION[:3]
CONTINUED = {"chatml": (CHATML, ASKED), "mixtral": (MIXTRAL, CONVERSATION[1:3]),
             "trailing-space-kept": (CHATML, ASKED[:2] + [{"role": "assistant", "content": "A young "}]),
             "trailing-space-trimmed": (TRIMMED, ASKED[:2] + [{"role": "assistant", "content": "A young "}]),
             "content-parts": (PARTS, [{"role": "user", "content": [{"type": "text", "text": "Who?"}]},
                                       {"role": "assistant", "content": [{"type": "text", "text": "A"},
                                                                         {"type": "text", "text": "young"}]}])}


@pytest.mark.parametrize("case", CONTINUED)
def test_continuing_the_final_message_equals_transformers(tmp_path, case):
    template, messages = CONTINUED[case]
    ours, theirs = both(checkpoint(tmp_path, template_config=template))
    text = ours.tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text == theirs.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert not text.endswith(("<|im_end|>\n", "</s>"))  # it ends inside the last message
    assert (ours.tokenizer.apply_chat_template(messages, return_dict=False, continue_final_message=True)
            == theirs.apply_chat_template(messages, return_dict=False, continue_final_message=True))


def test_chat_goes_on_with_the_final_message_and_refuses_a_new_turn_beside_it(tmp_path):
    with MoEModel.from_pretrained(checkpoint(tmp_path, template_config=CHATML)) as model:
        prompt = model.tokenizer.apply_chat_template(ASKED, continue_final_message=True, return_dict=False)
        free = model.generate([prompt], max_new_tokens=6, ignore_eos=True, temperature=0)[0]
        reply = model.chat(ASKED, max_new_tokens=6, ignore_eos=True, temperature=0, continue_final_message=True)
        assert reply.token_ids == free.token_ids
        with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt cannot both be set"):
            model.chat(ASKED, continue_final_message=True, add_generation_prompt=True)
        assert model.chat(ASKED, max_new_tokens=6, ignore_eos=True, temperature=0, continue_final_message=True) == reply


THINKING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
            "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
            "{% if m.thinking %}[{{ m.thinking }}]{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}")


@pytest.mark.parametrize("name", ["reasoning", "reasoning_content", "thinking"])
def test_a_replys_thinking_reaches_the_template_under_every_name_as_in_transformers(tmp_path, name):
    """vLLM's answers give `reasoning`, DeepSeek's and llama-server's `reasoning_content`; templates read one of
    `reasoning_content` (Qwen3) and `thinking` (gpt-oss). Sent back in the next turn, each reaches the template."""
    ours, theirs = both(checkpoint(tmp_path, template_config=THINKING))
    messages = [ASKED[1], {"role": "assistant", "content": "A young woman.", name: "Who is asked?"}, ASKED[1]]
    text = ours.tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == theirs.apply_chat_template(messages, tokenize=False) and "<think>Who is asked?</think>" in text
