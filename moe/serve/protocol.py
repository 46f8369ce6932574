"""OpenAI's request and response shapes for /v1/completions and /v1/chat/completions: fields checked into
`SamplingParams` (a bad value is a 400 naming it), unsupported OpenAI fields refused by name, unknown ones logged
and ignored (as vLLM does), and the responses, whole or as server-sent-event chunks."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

from moe.chat.template import check_switches
from moe.generation.loop import RowOutput
from moe.generation.params import SamplingParams
from moe.generation.structured import StructuredOutputsParams

log = logging.getLogger("moe.serve")

# The ways a request holds its answer to a structure: OpenAI's `response_format`, vLLM's `structured_outputs` and
# its older `guided_*` fields (each the StructuredOutputsParams field it names)
STRUCTURED = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
              "guided_grammar")
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "stream", "stream_options", "ignore_eos",
          "n", "user", "logprobs", "skip_special_tokens", "min_tokens", "include_stop_str_in_output", "logit_bias",
          "allowed_token_ids", "truncate_prompt_tokens", "bad_words", *STRUCTURED}
FIELDS = {"completions": COMMON | {"prompt", "echo"},
          "chat": COMMON | {"messages", "top_logprobs", "max_completion_tokens", "chat_template_kwargs",
                            "add_generation_prompt", "continue_final_message"},
          "tokenize": {"model", "prompt", "messages", "add_special_tokens", "chat_template_kwargs",
                       "add_generation_prompt", "continue_final_message"},
          "detokenize": {"model", "tokens"}}
# OpenAI's fields this server does not support, and vLLM's that would change an answer: refused by name
REFUSED = ("suffix", "best_of", "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
           "audio", "modalities", "prediction", "prompt_logprobs", "logits_processors")
# Values of refused fields that ask for what the server does anyway: OpenAI's defaults, which some clients send
AS_DEFAULT = {"tool_choice": "none"}
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "ignore_eos", "skip_special_tokens", "min_tokens", "include_stop_str_in_output",
            "logit_bias", "allowed_token_ids", "bad_words")


class ApiError(Exception):
    """An OpenAI error object: status, message, the parameter it concerns."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


@dataclass
class Parsed:
    params: SamplingParams
    stream: bool
    include_usage: bool
    max_tokens_given: bool
    score_only: bool = False  # echo with max_tokens 0 (vLLM's): the prompt and its log-probabilities, no token


def check_fields(body: object, kind: str, served: str) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name in REFUSED + (("echo",) if kind == "chat" else ()):
        if body.get(name) not in (None, False, [], {}, AS_DEFAULT.get(name)):
            raise ApiError(400, f"'{name}' is not supported by this server", name)
    unknown = sorted(set(body) - FIELDS[kind] - set(REFUSED))
    if unknown:
        log.warning("ignoring fields that are no part of the API: %s", ", ".join(unknown))
    model = body.get("model")
    if model is not None and model != served:
        raise ApiError(404, f"The model `{model}` does not exist (this server serves `{served}`)", "model",
                       "NotFoundError")
    return body


def choices_per_prompt(body: dict, prompts: int, capacity: int) -> int:
    """OpenAI's `n`: choices per prompt, each a sequence of its own; a request of more sequences than the server
    ever holds at once (running and waiting) could never be taken."""
    n = 1 if body.get("n") is None else body["n"]
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ApiError(400, f"n must be a positive integer, got {n!r}", "n")
    if prompts * n > capacity:
        raise ApiError(400, f"this request asks for {prompts * n} sequences ({prompts} prompt(s), n={n}); the server "
                            f"holds at most {capacity} at once (--max-num-seqs + --max-queue)",
                       "n" if n > 1 else "prompt")
    return n


def sampling(body: dict, kind: str, prompt_len: int, max_model_len: int, turn_end: int | None = None,
             defaults: dict | None = None) -> Parsed:
    """The request's SamplingParams, checked against the context: prompt + max_tokens must fit. A sampling value
    the request leaves out comes from `defaults` (the checkpoint's generation_config.json, as vLLM applies it), else
    OpenAI's (temperature 1, the rest off)."""
    name = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None else \
        "max_tokens"
    room = max_model_len - prompt_len
    if room < 1:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                            f"{prompt_len}, leaving no room to generate", "messages" if kind == "chat" else "prompt")
    given = body.get(name)
    max_tokens = given if given is not None else (16 if kind == "completions" else room)
    score_only = kind == "completions" and body.get("echo") is True and type(given) is int and given == 0
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > room:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                            "completion). Please reduce the prompt or the completion.", name)
    values = (defaults or {}) | {k: body[k] for k in SAMPLING if body.get(k) is not None}
    values.setdefault("temperature", 1.0)  # OpenAI's default, as vLLM applies it
    if "seed" not in values:
        values["seed"] = uuid.uuid4().int % 2**63
    stop = body.get("stop")
    stop_ids = list(body.get("stop_token_ids") or [])
    if turn_end is not None and turn_end not in stop_ids:
        stop_ids.append(turn_end)
    if not isinstance(body.get("echo", False), bool):
        raise ApiError(400, f"echo must be true or false, got {body['echo']!r}", "echo")
    logprobs = logprob_count(body, kind)
    structured = structured_outputs(body)
    try:
        params = SamplingParams(1 if score_only else max_tokens, **values, stop=() if stop is None else stop,
                                stop_token_ids=stop_ids, structured_outputs=structured,
                                logprobs=logprobs, prompt_logprobs=logprobs if body.get("echo") else None)
    except (ValueError, TypeError) as e:
        message = str(e)
        param = name if message.startswith("max_new_tokens") else message.split()[0].split("[")[0]  # logit_bias[5]
        raise ApiError(400, message, param) from None
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream must be true or false, got {stream!r}", "stream")
    if options and not stream:  # as vLLM refuses it
        raise ApiError(400, "stream_options can only be given with stream: true", "stream_options")
    return Parsed(params, stream, bool(options.get("include_usage")), given is not None, score_only)


def structured_outputs(body: dict) -> StructuredOutputsParams | None:
    """The structure a request holds its answer to, from whichever of `STRUCTURED` it gives (one at most)."""
    given = [k for k in STRUCTURED if body.get(k) is not None and not (k == "response_format" and isinstance(
        body[k], dict) and body[k].get("type") == "text")]
    if len(given) > 1:
        raise ApiError(400, f"give one of {', '.join(given)}: each holds the answer to a structure", given[1])
    if not given:
        return None
    name, value = given[0], body[given[0]]
    try:
        if name == "response_format":
            return _response_format(value)
        if name == "structured_outputs":
            return StructuredOutputsParams.of(value)
        return StructuredOutputsParams(**{name.removeprefix("guided_"): value})
    except ValueError as e:
        raise ApiError(400, str(e), name) from None


def _response_format(value: object) -> StructuredOutputsParams:
    """OpenAI's `response_format`: {"type": "json_object"}, or {"type": "json_schema", "json_schema": {"schema"}}."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = value.get("json_schema") if kind == "json_schema" else None
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise ValueError('response_format must be {"type": "text"}, {"type": "json_object"} or {"type": '
                         f'"json_schema", "json_schema": {{"name": ..., "schema": {{...}}}}}}, got {value!r}')
    return StructuredOutputsParams(json=spec["schema"])


def template_kwargs(body: dict, defaults: dict) -> dict:
    """The chat template's own switches (e.g. {"enable_thinking": false}): the server's defaults
    (`--chat-template-kwargs`), then the request's."""
    given = body.get("chat_template_kwargs")
    try:
        return defaults | check_switches({} if given is None else given)
    except ValueError as e:
        raise ApiError(400, f"chat_template_kwargs {e}", "chat_template_kwargs") from None


def generation_prompt(body: dict) -> tuple[bool, bool]:
    """vLLM's `add_generation_prompt` (default true: the template opens the assistant's turn) and
    `continue_final_message` (default false: the reply goes on with the last message instead); with the second
    set, the first defaults to false, and both true is refused with vLLM's words."""
    goes_on = body.get("continue_final_message", False)
    opens = body.get("add_generation_prompt", not goes_on)
    for name, value in (("add_generation_prompt", opens), ("continue_final_message", goes_on)):
        if not isinstance(value, bool):
            raise ApiError(400, f"{name} must be true or false, got {value!r}", name)
    if opens and goes_on:
        raise ApiError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                       "continue_final_message")
    return opens, goes_on


def logprob_count(body: dict, kind: str) -> int | None:
    if kind == "completions":
        return body.get("logprobs")
    if not body.get("logprobs"):
        if body.get("top_logprobs"):
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return body.get("top_logprobs") or 0


def new_id(kind: str) -> str:
    return ("cmpl-" if kind == "completions" else "chatcmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def logprobs_object(kind: str, entries, decode) -> dict | None:
    """OpenAI's log-probabilities: completions' token lists, or chat's `content` entries."""
    if entries is None:
        return None
    if kind == "completions":  # an echoed prompt's first token has no log-probability: None, as OpenAI's
        return {"tokens": [decode(t) for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [None if top is None else {decode(i): v for i, v in top} for _, _, top in entries]}
    return {"content": [{"token": decode(t), "logprob": lp, "bytes": list(decode(t).encode()),
                         "top_logprobs": [{"token": decode(i), "logprob": v, "bytes": list(decode(i).encode())}
                                          for i, v in top]} for t, lp, top in entries]}


def prompt_entries(prompt: list[int], scores: list) -> list[tuple]:
    """An echoed prompt's (token, log-probability, top) entries: none for its first token, as OpenAI's."""
    return [(prompt[0], None, None)] + [(t, lp, top) for t, (lp, top) in zip(prompt[1:], scores, strict=True)]


def choice(kind: str, index: int, text: str | None, reasoning: str | None, out: RowOutput | None,
           logprobs: dict | None, delta: bool) -> dict:
    """A choice, or a streamed chunk's (`delta`); `reasoning`: a chat answer's thinking, under vLLM's name and
    DeepSeek's (llama-server's)."""
    finish = out.finish_reason if out is not None else None
    stop_reason = out.stop_reason if out is not None else None
    if kind == "completions":
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": stop_reason}
    body = {"role": "assistant", "content": text} if not delta else ({"content": text} if text else {})
    if reasoning:
        body |= {"reasoning": reasoning, "reasoning_content": reasoning}
    return {"index": index, ("delta" if delta else "message"): body, "logprobs": logprobs, "finish_reason": finish,
            "stop_reason": stop_reason}


def envelope(kind: str, rid: str, served: str, choices: list[dict], chunk: bool, use: dict | None = None) -> dict:
    obj = {"completions": ("text_completion", "text_completion"), "chat": ("chat.completion",
                                                                         "chat.completion.chunk")}[kind][chunk]
    out = {"id": rid, "object": obj, "created": int(time.time()), "model": served, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out
