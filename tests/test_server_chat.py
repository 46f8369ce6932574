"""The server of a chat checkpoint (a `tokenizer.json` without BOS, a ChatML template, a generation_config.json
that samples), as clients meet it: the template and its switches, content parts, generation_config's defaults,
special tokens in the text, an empty prompt."""

from __future__ import annotations

import json

import httpx
import pytest

from moe import MoEModel, SamplingParams
from moe.generation.params import with_bad_word_ids
from tests.servers import Server
from tests.test_chat_template import CHATML, checkpoint

pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

GENERATION_CONFIG = {"do_sample": True, "temperature": 0.7, "top_k": 5}
NO_THINKING = {"enable_thinking": False}  # the chat server's --chat-template-kwargs


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    path = checkpoint(tmp_path_factory.mktemp("served-chat"), template_config=CHATML)
    (path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    with Server(path, "--api-key", "secret", "--chat-template-kwargs", '{"enable_thinking": false}') as s:
        yield s, path


def test_chat_completions_through_the_template(chat_server):
    server, path = chat_server
    messages = [{"role": "user", "content": "Who is Emma?"}]
    with MoEModel.from_pretrained(path) as model:
        want = model.chat(messages, max_new_tokens=10, temperature=0, template_kwargs=NO_THINKING)
    client = server.client(api_key="secret")
    got = client.chat.completions.create(model=path.name, messages=messages, max_tokens=10, temperature=0,
                                         logprobs=True, top_logprobs=2)
    assert got.choices[0].message.content == str(want) and got.choices[0].message.role == "assistant"
    assert len(got.choices[0].logprobs.content) == len(want.token_ids)
    chunks = list(client.chat.completions.create(model=path.name, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == str(want)
    assert server.post("/v1/chat/completions", {"messages": messages}).status_code == 401  # no key
    refused = server.post("/v1/chat/completions", {"messages": messages, "echo": True},
                          headers={"Authorization": "Bearer secret"})  # completions' echo; vLLM's chat one differs
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "echo"
    two = list(client.chat.completions.create(model=path.name, messages=messages, max_tokens=10, temperature=0, n=2,
                                              stream=True))
    assert [c.choices[0].delta.role for c in two[:2]] == ["assistant"] * 2 and [c.choices[0].index for c in two[:2]] \
        == [0, 1]  # each choice's role first
    for i in (0, 1):
        assert "".join(c.choices[0].delta.content or "" for c in two if c.choices[0].index == i) == str(want)


def test_chat_template_kwargs_default_from_the_command_line_and_the_requests_win(chat_server):
    server, path = chat_server
    headers = {"Authorization": "Bearer secret"}
    messages = [{"role": "user", "content": "Who is Emma?"}]
    tokenizer = MoEModel.from_pretrained(path).tokenizer
    for given, thinking in (({}, False), ({"chat_template_kwargs": {"enable_thinking": True}}, True)):
        got = server.post("/tokenize", {"messages": messages} | given, headers=headers).json()["tokens"]
        assert got == tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False,
                                                    enable_thinking=thinking)
    closed = server.post("/tokenize", {"messages": messages, "add_generation_prompt": False}, headers=headers)
    assert closed.json()["tokens"] == tokenizer.apply_chat_template(messages, return_dict=False)  # vLLM's field
    bad = server.post("/v1/chat/completions", {"messages": messages, "add_generation_prompt": 1}, headers=headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "add_generation_prompt"
    for bad, why in (("x", "must be an object"), ([1], "must be an object"), (0, "must be an object"),
                     ({"messages": []}, "may not set messages")):
        response = server.post("/v1/chat/completions", {"messages": messages, "chat_template_kwargs": bad},
                               headers=headers)
        assert response.status_code == 400 and why in response.json()["error"]["message"], response.text
        assert response.json()["error"]["param"] == "chat_template_kwargs"


def test_continue_final_message_goes_on_with_the_last_message_as_vllm_does(chat_server):
    server, path = chat_server
    messages = [{"role": "user", "content": "Who is Emma?"}, {"role": "assistant", "content": "She is"}]
    with MoEModel.from_pretrained(path) as model:
        want = model.chat(messages, max_new_tokens=8, temperature=0, ignore_eos=True, continue_final_message=True)
        ids = model.tokenizer.apply_chat_template(messages, continue_final_message=True, return_dict=False)
    got = server.client(api_key="secret").chat.completions.create(
        model=path.name, messages=messages, max_tokens=8, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True})
    assert got.choices[0].message.content == str(want) and got.usage.prompt_tokens == len(ids)
    headers = {"Authorization": "Bearer secret"}
    tokens = server.post("/tokenize", {"messages": messages, "continue_final_message": True}, headers=headers)
    assert tokens.json()["tokens"] == ids  # add_generation_prompt left out: off beside continue_final_message
    both = server.post("/v1/chat/completions", {"messages": messages, "continue_final_message": True,
                                                "add_generation_prompt": True}, headers=headers)
    assert both.status_code == 400 and "Cannot set both `continue_final_message`" in both.json()["error"]["message"]


def test_openais_defaults_of_unsupported_fields_are_taken_and_the_rest_refused(chat_server):
    server, path = chat_server
    client, messages = server.client(api_key="secret"), [{"role": "user", "content": "Who is Emma?"}]
    plain = client.chat.completions.create(model=path.name, messages=messages, max_tokens=4, temperature=0)
    same = client.chat.completions.create(model=path.name, messages=messages, max_tokens=4, temperature=0,
                                          tool_choice="none", response_format={"type": "text"})
    assert same.choices[0].message.content == plain.choices[0].message.content
    for field, value in (("tool_choice", "auto"), ("response_format", {"type": "xml"})):
        response = server.post("/v1/chat/completions", {"messages": messages, field: value},
                               headers={"Authorization": "Bearer secret"})
        assert response.status_code == 400 and response.json()["error"]["param"] == field


def test_truncate_prompt_tokens_reads_the_prompts_last_tokens_as_vllm_does(chat_server):
    """The answer, the usage and an echo are those of the prompt's last K tokens given as the prompt."""
    server, path = chat_server
    headers, fixed = {"Authorization": "Bearer secret"}, {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    tokenizer = MoEModel.from_pretrained(path).tokenizer
    text = "Emma Woodhouse, handsome, clever, and rich, with a comfortable home"
    tail = tokenizer.encode(text)[-4:]
    cut = server.post("/v1/completions", {"prompt": text, "truncate_prompt_tokens": 4, "echo": True} | fixed,
                      headers=headers).json()
    whole = server.post("/v1/completions", {"prompt": tail} | fixed, headers=headers).json()
    echoed = tokenizer.decode(tail)
    assert cut["choices"][0]["text"] == echoed + whole["choices"][0]["text"] and cut["usage"]["prompt_tokens"] == 4
    messages = [{"role": "user", "content": text}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False, **NO_THINKING)
    end = tokenizer.encode_special("<|im_end|>")[0]
    chat = server.post("/v1/chat/completions", {"messages": messages, "truncate_prompt_tokens": 5} | fixed,
                       headers=headers).json()
    same = server.post("/v1/completions", {"prompt": ids[-5:], "stop_token_ids": [end]} | fixed, headers=headers)
    assert chat["choices"][0]["message"]["content"] == same.json()["choices"][0]["text"]
    assert chat["usage"]["prompt_tokens"] == 5 < len(ids)
    for bad in (0, -2, 10**6, "4"):
        response = server.post("/v1/completions", {"prompt": text, "truncate_prompt_tokens": bad}, headers=headers)
        assert response.status_code == 400 and response.json()["error"]["param"] == "truncate_prompt_tokens"


def test_bad_words_hold_back_a_word_of_the_answer_as_generate_does(chat_server):
    server, path = chat_server
    fixed = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with MoEModel.from_pretrained(path) as model:
        plain = model.generate(["Emma Woodhouse"], max_new_tokens=8, temperature=0, ignore_eos=True)[0]
        def read_as(word: str) -> tuple:
            return with_bad_word_ids(SamplingParams(bad_words=[word]), model.tokenizer).bad_words_ids

        pairs = [tuple(plain.token_ids[i:i + 2]) for i in range(len(plain.token_ids) - 1)]
        texts = [model.tokenizer.decode(list(pair)) for pair in pairs]  # the first pair whose text reads as it
        word = next(t for pair, t in zip(pairs, texts, strict=True) if t.strip() and pair in read_as(t))
        want = model.generate(["Emma Woodhouse"], SamplingParams(bad_words=[word], **fixed))[0]
    got = server.post("/v1/completions", {"prompt": "Emma Woodhouse", "bad_words": [word]} | fixed,
                      headers={"Authorization": "Bearer secret"}).json()
    assert got["choices"][0]["text"] == str(want) != str(plain)
    blank = server.post("/v1/completions", {"prompt": "Emma", "bad_words": [" "]},
                        headers={"Authorization": "Bearer secret"})
    assert blank.status_code == 400 and blank.json()["error"]["param"] == "bad_words"


def test_echo_with_max_tokens_0_gives_the_prompt_and_its_logprobs_alone_as_vllm_does(chat_server):
    """A scoring request (HELM's form): the prompt's text and log-probabilities, those of the same request with one
    token more, without the token; no token made, whole or streamed."""
    server, path = chat_server
    client, text = server.client(api_key="secret"), "Emma Woodhouse, handsome, clever, and rich"
    ask = dict(model=path.name, prompt=[text, "It is a truth"], echo=True, logprobs=2, temperature=0)
    scored, one_more = (client.completions.create(max_tokens=n, **ask) for n in (0, 1))
    for a, b in zip(scored.choices, one_more.choices, strict=True):
        prompt_tokens = len(a.logprobs.tokens)
        assert b.text.startswith(a.text) and a.finish_reason == "length" and prompt_tokens == len(b.logprobs.tokens) - 1
        assert a.logprobs.token_logprobs == b.logprobs.token_logprobs[:prompt_tokens]
        assert a.logprobs.top_logprobs == b.logprobs.top_logprobs[:prompt_tokens]
    assert scored.choices[0].text == text and scored.usage.completion_tokens == 0
    chunks = list(client.completions.create(max_tokens=0, stream=True, **ask))
    for i, c in enumerate(scored.choices):
        mine = [x for chunk in chunks for x in chunk.choices if x.index == i]
        assert "".join(x.text for x in mine) == c.text and mine[-1].finish_reason == "length"
        assert [v for x in mine if x.logprobs for v in x.logprobs.token_logprobs] == c.logprobs.token_logprobs
    plain = client.completions.create(model=path.name, prompt=text, echo=True, max_tokens=0)
    assert plain.choices[0].text == text and plain.choices[0].logprobs is None
    refused = server.post("/v1/completions", {"prompt": text, "max_tokens": 0},
                          headers={"Authorization": "Bearer secret"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"  # without echo


def test_content_parts_read_as_vllm_reads_them(chat_server):
    """OpenAI's list of content parts: text parts joined by a newline for this template, which prints a string
    (`moe.chat.template.text_content`); an image part is refused by name."""
    server, path = chat_server
    client = server.client(api_key="secret")
    parts = [{"type": "text", "text": "Who is"}, {"type": "text", "text": "Emma?"}]
    got = client.chat.completions.create(model=path.name, messages=[{"role": "user", "content": parts}],
                                         max_tokens=8, temperature=0)
    with MoEModel.from_pretrained(path) as model:
        want = model.chat([{"role": "user", "content": "Who is\nEmma?"}], max_new_tokens=8, temperature=0,
                          template_kwargs=NO_THINKING)
    assert got.choices[0].message.content == str(want) and got.usage.prompt_tokens == want.prompt_tokens
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]
    response = server.post("/v1/chat/completions", {"messages": image}, headers={"Authorization": "Bearer secret"})
    assert response.status_code == 400 and "'image_url' is not supported" in response.json()["error"]["message"]


def test_an_empty_prompt_of_a_tokenizer_without_bos_is_refused_and_the_server_goes_on(chat_server):
    """The chat server's tokenizer adds no BOS: an empty text is no tokens at all (vLLM: 400 too)."""
    server, path = chat_server
    headers = {"Authorization": "Bearer secret"}
    for body in ({"prompt": ""}, {"prompt": ["And", ""]}):
        response = server.post("/v1/completions", body | {"max_tokens": 3}, headers=headers)
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text
    good = server.post("/v1/completions", {"prompt": "And", "max_tokens": 2}, headers=headers)
    assert good.status_code == 200 and httpx.get(server.url + "/health").status_code == 200


def test_special_tokens_are_left_out_of_the_text_unless_asked_as_vllm_does(chat_server):
    """Random weights at a high temperature write special tokens: the text is transformers' decode that skips
    them, unless the request says `skip_special_tokens: false` (vLLM's field), whole and streamed."""
    transformers = pytest.importorskip("transformers")
    server, path = chat_server
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    prompt, headers = [5, 9, 11], {"Authorization": "Bearer secret"}
    sample = dict(max_new_tokens=40, temperature=30.0, ignore_eos=True)  # near-uniform: some tokens are special
    with MoEModel.from_pretrained(path) as model:
        seed, ids = next((s, ids) for s in range(50) if set(ids := list(model.generate([prompt], seed=s, **sample)[0]))
                         & set(theirs.added_tokens_decoder))
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 30.0, "seed": seed}
    for skip in (True, False):
        want = theirs.decode(prompt + ids, skip_special_tokens=skip)[len(theirs.decode(prompt,
                                                                                       skip_special_tokens=skip)):]
        given = {"ignore_eos": True} | ({} if skip else {"skip_special_tokens": False})
        got = server.post("/v1/completions", body | given, headers=headers).json()["choices"][0]["text"]
        streamed = server.client(api_key="secret").completions.create(model=path.name, stream=True, **body,
                                                                      extra_body=given)
        assert got == want == "".join(c.choices[0].text for c in streamed)


def test_a_request_without_sampling_values_takes_generation_configs(chat_server):
    """As vLLM serves by default: what a request leaves out comes from generation_config.json (here temperature 0.7
    and top_k 5), what it gives wins (top_p), and OpenAI's defaults fill the rest."""
    server, path = chat_server
    messages = [{"role": "user", "content": "Who is Emma?"}]
    client = server.client(api_key="secret")
    got = [client.chat.completions.create(model=path.name, messages=messages, max_tokens=12, seed=seed, top_p=0.9)
           .choices[0].message.content for seed in (3, 4)]
    with MoEModel.from_pretrained(path) as model:
        want = [str(model.chat(messages, max_new_tokens=12, seed=seed, temperature=0.7, top_k=5, top_p=0.9,
                               template_kwargs=NO_THINKING))
                for seed in (3, 4)]
        openais = [str(model.chat(messages, max_new_tokens=12, seed=seed, temperature=1.0, top_k=0, top_p=0.9,
                                  template_kwargs=NO_THINKING))
                   for seed in (3, 4)]
    assert got == want and got != openais


def test_a_reply_that_ends_its_turn_has_no_stop_reason_unless_the_request_named_that_id(tmp_path):
    """The template's end of turn ends a reply as an end-of-sequence id does: stop_reason null, as `model.chat`
    says it and vLLM (which reads it as an EOS); a request that names the id among its stop_token_ids gets it."""
    from tests.test_chat_template import steer_towards

    path = checkpoint(tmp_path, template_config=CHATML)
    messages = [{"role": "user", "content": "Who is Emma?"}]
    with MoEModel.from_pretrained(path) as model:
        end = model.tokenizer.encode_special("<|im_end|>")[0]
        prompt = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        free = model.generate([prompt], max_new_tokens=12, ignore_eos=True, temperature=0)[0]
    steer_towards(path, end, free.token_ids[4])
    with MoEModel.from_pretrained(path) as model:
        want = model.chat(messages, max_new_tokens=12, temperature=0)
    assert want.finish_reason == "stop" and want.stop_reason is None and len(want.token_ids) < 12
    with Server(path) as server:
        body = {"messages": messages, "max_tokens": 12, "temperature": 0}
        got = server.post("/v1/chat/completions", body).json()["choices"][0]
        named = server.post("/v1/chat/completions", body | {"stop_token_ids": [end]}).json()["choices"][0]
    assert got["message"]["content"] == str(want) and (got["finish_reason"], got["stop_reason"]) == ("stop", None)
    assert named["message"]["content"] == str(want) and named["stop_reason"] == end


def test_a_reasoning_parser_puts_the_open_think_part_under_reasoning_whole_and_streamed(tmp_path):
    """`--reasoning-parser qwen3`: a reply continuing an open `<think>` is reasoning (vLLM's `reasoning`, DeepSeek's
    `reasoning_content`) with no content, whole and streamed alike; a reply outside one is content as before."""
    path = checkpoint(tmp_path, template_config=CHATML)
    thinking = [{"role": "user", "content": "Who is Emma?"}, {"role": "assistant", "content": "<think>Emma is"}]
    plain = [{"role": "user", "content": "Who is Emma?"}]
    kw = dict(max_new_tokens=8, temperature=0, ignore_eos=True)
    with MoEModel.from_pretrained(path) as model:
        thought = str(model.chat(thinking, continue_final_message=True, **kw))
        answer = str(model.chat(plain, **kw))
    with Server(path, "--reasoning-parser", "qwen3") as server:
        client, fixed = server.client(), dict(model=path.name, max_tokens=8, temperature=0)
        extra = {"continue_final_message": True, "ignore_eos": True}
        whole = client.chat.completions.create(messages=thinking, extra_body=extra, **fixed).choices[0].message
        assert whole.content is None and whole.reasoning == whole.reasoning_content == thought
        chunks = list(client.chat.completions.create(messages=thinking, extra_body=extra, stream=True, **fixed))
        assert "".join(getattr(c.choices[0].delta, "reasoning", None) or "" for c in chunks) == thought
        assert not any(c.choices[0].delta.content for c in chunks)
        other = client.chat.completions.create(messages=plain, extra_body={"ignore_eos": True}, **fixed)
        assert other.choices[0].message.content == answer and getattr(other.choices[0].message, "reasoning", None) \
            is None


def test_structured_outputs_through_the_openai_client_equal_chat(chat_server):
    """vLLM's `structured_outputs` and `guided_choice`, and OpenAI's `response_format` with a JSON schema, whole and
    streamed: the answers of `model.chat` with the same structure."""
    from tests.test_structured import CHOICE, SCHEMA

    pytest.importorskip("llguidance")
    server, path = chat_server
    client, messages = server.client(api_key="secret"), [{"role": "user", "content": "Who is Emma?"}]
    compact = {"json": SCHEMA, "disable_any_whitespace": True}
    with MoEModel.from_pretrained(path) as model:
        def chat(spec: dict, n: int) -> str:
            return str(model.chat(messages, SamplingParams(max_tokens=n, structured_outputs=spec),
                                  template_kwargs=NO_THINKING))

        want, loose, choice = chat(compact, 48), chat({"json": SCHEMA}, 24), chat({"choice": CHOICE}, 24)
    ask = dict(model=path.name, messages=messages, temperature=0)
    got = client.chat.completions.create(max_tokens=48, extra_body={"structured_outputs": compact}, **ask)
    assert got.choices[0].message.content == want and json.loads(want)["name"] in ("Emma", "Harriet")
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    assert client.chat.completions.create(max_tokens=24, response_format=schema, **ask).choices[0].message.content \
        == loose
    chunks = client.chat.completions.create(max_tokens=24, extra_body={"guided_choice": CHOICE}, stream=True, **ask)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice and choice in CHOICE
