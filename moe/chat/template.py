"""A checkpoint's chat template, found and rendered the way transformers does it.

Found: `chat_template.jinja` beside the weights first, then `tokenizer_config.json`'s `chat_template` (a string, or
a list of named templates where "default" is taken unless a name is asked for). Rendered with jinja2 in an immutable
sandbox (templates from the Hub are untrusted code) with `trim_blocks` and `lstrip_blocks`, loop controls, the
`{% generation %}` tag, `raise_exception`, `strftime_now` and a `tojson` that does not escape HTML; the variables
are `messages`, `tools`, `documents`, `add_generation_prompt`, the special tokens' text and the caller's keywords.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

from moe.checkpoint.files import CheckpointError


class NoChatTemplate(ValueError):
    pass


def find_chat_template(directory: Path) -> str | None:
    """The template's source, or None when the checkpoint ships none."""
    path = directory / "chat_template.jinja"
    if path.exists():
        return path.read_text()
    found = _configured(directory)
    if isinstance(found, list):
        return named_templates(directory).get("default")
    return found if isinstance(found, str) else None


def named_templates(directory: Path) -> dict[str, str]:
    """`tokenizer_config.json`'s named templates ([{"name": ..., "template": ...}]), if it has a list of them."""
    found = _configured(directory)
    if not isinstance(found, list):
        return {}
    return {t["name"]: t["template"] for t in found if isinstance(t, dict) and "name" in t and "template" in t}


def _configured(directory: Path) -> object:
    config = directory / "tokenizer_config.json"
    if not config.exists():
        return None
    try:
        return json.loads(config.read_text()).get("chat_template")
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{config}: cannot parse JSON ({e})") from None


def read_template_file(path: str | Path) -> str:
    """A template given by the user (`--chat-template FILE`)."""
    try:
        return Path(path).read_text()
    except OSError as e:
        raise NoChatTemplate(f"--chat-template {path}: cannot read it ({e.strerror})") from None


@functools.lru_cache(maxsize=8)
def compiled(source: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering keeps it."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise NoChatTemplate(f"the chat template does not parse: {e.message} (line {e.lineno})") from None


def render(source: str, messages: list[dict], special: dict[str, str], add_generation_prompt: bool = False,
           tools: list[dict] | None = None, documents: list[dict] | None = None,
           continue_final_message: bool = False, **extra) -> str:
    """The conversation as the template writes it. A message is a dict with at least `role`; keys whose value is
    None are dropped (as transformers does). `continue_final_message`: the text ends inside the last message, right
    after its content, for the model to go on writing it (transformers' and vLLM's switch of this name)."""
    import jinja2

    check_messages(messages)
    messages = [_reasoning_aliased({k: v for k, v in m.items() if v is not None}) for m in messages]
    if continue_final_message:
        if add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set: the first goes on "
                             "with the last message, the second opens a new one")
        messages[-1] = _marked(messages[-1])
    try:
        text = compiled(source).render(messages=messages, tools=tools, documents=documents,
                                       add_generation_prompt=add_generation_prompt, **(special | extra))
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"the chat template refused the conversation: {e}") from None
    return _cut_at_mark(text) if continue_final_message else text


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the names a reply's thinking comes under


def _reasoning_aliased(message: dict) -> dict:
    """A message's thinking under the names templates read (Qwen3's `reasoning_content`, gpt-oss's `thinking`),
    whichever the client sent (vLLM's answers give `reasoning`), as transformers 5 fills them."""
    found = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    return message if found is None else {"thinking": found, **message, "reasoning_content": found}


# Appended to the last message's text to find where it ends in the rendered conversation; the space tells whether
# the template strips the message's trailing space, which the cut then strips too (as transformers does).
CONTINUE_MARK = "<<moe:continue-final-message>> "


def _marked(message: dict) -> dict:
    content = message.get("content")
    if isinstance(content, str):
        return message | {"content": content + CONTINUE_MARK}
    texts = [i for i, part in enumerate(content or ()) if isinstance(part, dict) and "text" in part]
    if not texts:
        raise ValueError("continue_final_message: the last message has no text to continue")
    parts = list(content)
    parts[texts[-1]] = parts[texts[-1]] | {"text": parts[texts[-1]]["text"] + CONTINUE_MARK}
    return message | {"content": parts}


def _cut_at_mark(text: str) -> str:
    at = text.rfind(CONTINUE_MARK.strip())
    if at < 0:
        raise ValueError("continue_final_message: the chat template does not write the last message's content")
    return text[:at] if text.startswith(CONTINUE_MARK, at) else text[:at].rstrip()


# The names a chat template gets from the call itself, which its own switches (`chat_template_kwargs`) may not set
TEMPLATE_OWN = {"messages", "add_generation_prompt", "tools", "documents", "chat_template", "tokenize", "return_dict",
                "continue_final_message"}


def check_switches(switches: object) -> dict:
    """A template's own switches, as a request or a command line gives them: an object of other names than
    `TEMPLATE_OWN`."""
    if not isinstance(switches, dict):
        raise ValueError(f"must be an object, got {switches!r}")
    if taken := sorted(TEMPLATE_OWN & switches.keys()):
        raise ValueError(f"may not set {', '.join(taken)} (the call's own)")
    return switches


def check_messages(messages: object) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("a conversation is a non-empty list of messages ({'role': ..., 'content': ...})")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"message {i} must be a dict with a 'role' (and usually 'content'), got {m!r}")


def end_of_turn_text(source: str, special: dict[str, str]) -> str:
    """The text the template writes right after an assistant's reply (e.g. "</s>", "<|im_end|>\\n"), found by
    rendering a two-turn conversation; "" where the template ends a reply with nothing."""
    reply = "Qx7Zr"
    try:
        text = render(source, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply}], special)
    except ValueError:
        return ""
    at = text.rfind(reply)
    return text[at + len(reply):] if at >= 0 else ""


@functools.lru_cache(maxsize=32)
def end_of_turn_id(tokenizer, source: str) -> int | None:
    """The special token that ends an assistant's turn in this template (e.g. "<|im_end|>", "</s>"), or None; found
    once per tokenizer and template (every chat call and server request asks)."""
    tail = end_of_turn_text(source, tokenizer.special_texts).strip()
    ids = tokenizer.encode_special(tail) if tail else []
    return ids[0] if ids and tokenizer.is_special(ids[0]) else None


@functools.lru_cache(maxsize=8)
def takes_content_parts(source: str) -> bool:
    """The template loops over a message's content, so it reads OpenAI's list of parts itself (Qwen's do); else it
    prints the content as a string. vLLM tells the two apart the same way, from the template's syntax tree."""
    import jinja2

    def is_content(node) -> bool:
        return (isinstance(node, jinja2.nodes.Getattr) and node.attr == "content") or (
            isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == "content")

    tree = compiled(source).environment.parse(source)  # the rendering environment: its tags parse
    return any(is_content(loop.iter) for loop in tree.find_all(jinja2.nodes.For))


def text_content(messages: list, source: str) -> list:
    """OpenAI messages whose content is a list of parts, made what the template reads, as vLLM serves them: text
    parts joined by newlines where the template prints a string, the parts kept where it loops over them. A part
    that is not text (an image, audio) is refused: these models read text."""
    check_messages(messages)
    keep = takes_content_parts(source)
    out = []
    for i, m in enumerate(messages):
        parts = m.get("content")
        if isinstance(parts, list):
            for part in parts:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"message {i}: a content part of type {kind!r} is not supported (the model "
                                     "reads text: parts {'type': 'text', 'text': ...})")
            m = m | {"content": [{"type": "text", "text": p["text"]} for p in parts] if keep
                     else "\n".join(p["text"] for p in parts)}
        out.append(m)
    return out
