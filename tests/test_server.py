"""The OpenAI-compatible server as clients meet it: a real server process, the official `openai` client
(`max_retries=0`) and raw HTTP. Greedy answers equal `MoEModel.generate`; concurrent ones equal solo ones."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from moe import MoEModel, SamplingParams
from moe.parallel.distributed import free_port
from tests.checkpoints import ROOT, TRAINED, tiny_config, write_checkpoint
from tests.servers import Server
from tests.waiting import wait_gone, wait_until

pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

PROMPTS = ["It is a truth universally acknowledged, that", "And God said", "Emma Woodhouse, handsome, clever",
           "The", "In the beginning", "She was"]


@pytest.fixture(scope="module")
def server():
    with Server(TRAINED, "--max-num-seqs", "4", "--served-model-name", "austen") as s:
        yield s


@pytest.fixture(scope="module")
def local():
    with MoEModel.from_pretrained(TRAINED) as model:
        yield model


def test_greedy_completions_equal_generate_whole_and_streamed(server, local):
    client = server.client()
    want = local.generate(PROMPTS[:2], max_new_tokens=12, temperature=0)
    got = client.completions.create(model="austen", prompt=PROMPTS[:2], max_tokens=12, temperature=0)
    assert [c.text for c in got.choices] == [str(w) for w in want] and got.object == "text_completion"
    assert [c.finish_reason for c in got.choices] == ["length", "length"]
    assert got.usage.prompt_tokens == sum(w.prompt_tokens for w in want) and got.usage.completion_tokens == 24
    chunks = list(client.completions.create(model="austen", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == str(want[0])
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-2].choices[0].finish_reason == "length"


def test_logit_bias_through_the_openai_client_equals_generate(server, local):
    plain = local.generate(PROMPTS[1], max_new_tokens=8, temperature=0)[0]
    bias = {plain.token_ids[0]: -100, plain.token_ids[3]: 5}
    want = local.generate(PROMPTS[1], max_new_tokens=8, temperature=0, logit_bias=bias)[0]
    got = server.client().completions.create(model="austen", prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                             logit_bias={str(i): v for i, v in bias.items()})
    assert got.choices[0].text == str(want) != str(plain)
    allowed = sorted(set(plain.token_ids[2:6]))  # vLLM's allowed_token_ids, through the client's extra_body
    kept = local.generate(PROMPTS[1], SamplingParams(max_tokens=8, allowed_token_ids=allowed))[0]
    got = server.client().completions.create(model="austen", prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                             extra_body={"allowed_token_ids": allowed})
    assert got.choices[0].text == str(kept) and set(kept.token_ids) <= set(allowed)


def test_echo_with_logprobs_as_lm_eval_asks_scores_the_prompt_as_transformers_does(server, local):
    """lm-eval-harness's loglikelihood request (token-id prompts, max_tokens 1, logprobs 1, echo, greedy): each
    prompt token's log-probability is transformers' log-softmax of the tokens before it (none for the first); the text
    and the entries are the prompt's, then the answer's; streamed, they add up to the same."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(TRAINED), dtype=torch.float32)
    ids = [local.tokenizer.encode(p) for p in PROMPTS[:2]]
    ask = dict(model="austen", prompt=ids, max_tokens=1, logprobs=1, echo=True, temperature=0)
    got = server.client().completions.create(**ask)
    for prompt, c in zip(ids, got.choices, strict=True):
        with torch.no_grad():
            logp = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
        want = logp[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
        lp, top = c.logprobs.token_logprobs, c.logprobs.top_logprobs
        assert lp[0] is None and top[0] is None and len(lp) == len(prompt) + 1
        assert max(abs(a - b) for a, b in zip(lp[1:len(prompt)], want, strict=True)) < 1e-4
        assert [max(t.values()) for t in top[1:len(prompt)]] == pytest.approx(logp[:-1].max(-1).values.tolist(),
                                                                              abs=1e-4)
        answer = local.generate(prompt, max_new_tokens=1, temperature=0)[0]
        assert c.text == local.tokenizer.decode(prompt) + answer.text
    chunks = list(server.client().completions.create(**ask, stream=True))
    for i, c in enumerate(got.choices):
        mine = [x for chunk in chunks for x in chunk.choices if x.index == i]
        assert "".join(x.text for x in mine) == c.text
        assert [v for x in mine if x.logprobs for v in x.logprobs.token_logprobs] == c.logprobs.token_logprobs


def test_token_prompts_stop_strings_and_logprobs(server, local):
    ids = local.tokenizer.encode(PROMPTS[0])
    want = local.generate([ids], max_new_tokens=16, temperature=0, stop=[","], logprobs=2)[0]
    body = {"prompt": ids, "max_tokens": 16, "temperature": 0, "stop": [","], "logprobs": 2}
    got = server.post("/v1/completions", body).json()["choices"][0]
    assert got["text"] == want.text and got["finish_reason"] == "stop" and got["stop_reason"] == ","
    kept = server.post("/v1/completions", body | {"include_stop_str_in_output": True}).json()["choices"][0]
    assert kept["text"] == want.text + "," and kept["stop_reason"] == ","  # vLLM's field
    assert got["logprobs"]["token_logprobs"] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
    assert "".join(got["logprobs"]["tokens"]) == kept["text"]  # each token's text as in the text (spaces kept),
    # the token that holds the stop string too, as vLLM lists it
    held = local.generate([ids], max_new_tokens=16, temperature=0, stop=[" "], min_tokens=5)[0]  # vLLM's field
    body = {"prompt": ids, "max_tokens": 16, "temperature": 0, "stop": [" "], "min_tokens": 5}
    assert server.post("/v1/completions", body).json()["choices"][0]["text"] == held.text and len(held.token_ids) > 5


def test_n_choices_per_prompt_are_sequences_seeded_apart_in_openais_order(server, local):
    """Choice i*n + j is prompt i's j-th sequence, sampled with seed + j; the prompts count once in the usage."""
    client = server.client()
    got = client.completions.create(model="austen", prompt=PROMPTS[:2], n=3, max_tokens=8, temperature=0.8, seed=7)
    want = [local.generate([p], max_new_tokens=8, temperature=0.8, seed=7 + j)[0] for p in PROMPTS[:2]
            for j in range(3)]
    assert [c.index for c in got.choices] == list(range(6)) and [c.text for c in got.choices] == [str(w) for w in want]
    assert len(set(got.choices[i].text for i in range(3))) > 1  # sampled apart
    assert got.usage.prompt_tokens == want[0].prompt_tokens + want[3].prompt_tokens
    chunks = client.completions.create(model="austen", prompt=PROMPTS[:2], n=3, max_tokens=8, temperature=0.8, seed=7,
                                       stream=True)
    texts = [""] * 6
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == [str(w) for w in want]


def test_twelve_concurrent_requests_equal_solo_ones(server, local):
    client = server.client()
    jobs = [(PROMPTS[i % len(PROMPTS)], 8 + i, 0.0 if i % 2 else 0.8, i) for i in range(12)]

    def ask(job):
        prompt, n, temperature, seed = job
        return client.completions.create(model="austen", prompt=prompt, max_tokens=n, temperature=temperature,
                                         seed=seed).choices[0].text

    with ThreadPoolExecutor(12) as pool:
        together = list(pool.map(ask, jobs))
    assert together == [ask(job) for job in jobs]  # one at a time
    greedy = [j for j in jobs if j[2] == 0]
    assert [t for t, j in zip(together, jobs, strict=True) if j[2] == 0] == [
        str(local.generate([p], max_new_tokens=n, temperature=0)[0]) for p, n, _, _ in greedy]


BAD = [
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "top_k": -5}, 400, "top_k"),
    ({"prompt": "x", "min_p": 3}, 400, "min_p"),
    ({"prompt": "x", "presence_penalty": 9}, 400, "presence_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"prompt": "x", "logprobs": 99}, 400, "logprobs"),
    ({"prompt": "x", "stop": [""]}, 400, "stop"),
    ({"prompt": "x", "seed": "a"}, 400, "seed"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ({"prompt": "x", "n": 1000}, 400, "n"),
    ({"prompt": ["x"] * 100}, 400, "prompt"),
    ({"prompt": "x", "echo": "yes"}, 400, "echo"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ({"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ({"prompt": "x", "allowed_token_ids": [999999]}, 400, "allowed_token_ids"),
    ({"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"prompt": "x", "guided_regex": "("}, 400, "guided_regex"),  # vLLM's: a regex that does not compile
    ({"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "structured_outputs"),
    ({"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": "x", "model": "nope"}, 404, "model"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "skip_special_tokens": "no"}, 400, "skip_special_tokens"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ([1, 2], 400, None),
]


@pytest.mark.parametrize("body, status, param", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_openais_error_object_and_the_server_goes_on(server, body, status, param):
    response = server.post("/v1/completions", body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["code"] == status
    good = server.post("/v1/completions", {"prompt": "And", "max_tokens": 2})
    assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"] == "length"


def test_raw_http_errors_health_models_tokenize(server, local):
    assert server.post("/v1/completions", content=b"{not json").status_code == 400
    assert server.post("/v1/completions", content=b"x" * (9 * 2**20)).status_code == 413
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert [m.id for m in server.client().models.list().data] == ["austen"]
    ids = server.post("/tokenize", {"prompt": PROMPTS[0]}).json()["tokens"]
    assert ids == local.tokenizer.encode(PROMPTS[0])
    assert server.post("/detokenize", {"tokens": ids}).json()["prompt"] == local.tokenizer.decode(ids)
    chat = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "chat template" in chat.json()["error"]["message"]  # this model has none
    assert server.post("/v1/completions", {"prompt": "And", "max_tokens": 2}).status_code == 200  # a first request
    metrics = httpx.get(server.url + "/metrics").text
    assert "moe_generation_tokens_total" in metrics and 'moe_expert_tokens_total{block="0",expert="0"}' in metrics


def test_backpressure_cancellation_and_sigterm(tmp_path):
    with Server(TRAINED, "--max-num-seqs", "1", "--max-queue", "1", "--max-model-len", "1024",
                "--drain-timeout", "600") as server:  # a slow machine still finishes the stream within the drain
        body = {"prompt": "And", "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=120) as http, http.stream("POST", server.url + "/v1/completions", json=body) as one:
            lines = one.iter_lines()
            assert next(lines).startswith("data: ")  # the first sequence runs
            queued = httpx.Client(timeout=120)
            with queued.stream("POST", server.url + "/v1/completions", json=body | {"max_tokens": 4}) as two:
                refused = server.post("/v1/completions", body | {"stream": False})  # the queue holds one
                assert refused.status_code == 503 and refused.headers["retry-after"]
                assert refused.json()["error"]["type"] == "ServiceUnavailable"
                one.close()  # the client goes away: its slot frees, the queued request runs
                text = [json.loads(x[6:]) for x in two.iter_lines() if x.startswith("data: {")]
                assert text[-1]["choices"][0]["finish_reason"] == "length"
            queued.close()
        server.proc.send_signal(signal.SIGUSR1)  # every thread's stack to stderr, and it goes on
        assert server.post("/v1/completions", {"prompt": "And", "max_tokens": 2}).status_code == 200
        body = {"prompt": "And", "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=120) as http, http.stream("POST", server.url + "/v1/completions", json=body) as s:
            lines = s.iter_lines()
            next(lines)
            server.proc.send_signal(15)  # SIGTERM while it streams: the stream is finished, then the server exits
            rest = [x for x in lines if x]
        assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in rest[-2]
        assert server.stop() == 0
        assert 'File "' in server.said and "(most recent call first)" in server.said


MIXED = {"world_size": 2, "embed_rank": 0, "head_rank": 1,
         "blocks": [{"attention": "replicated", "experts": "expert"}, {"attention": "layer", "ranks": [1],
                                                                        "experts": "expert"}] * 2}


@pytest.mark.parametrize("layout", [[], ["--attention", "replicated"], ["--placement", "mixed"]],
                         ids=["layer", "replicated", "mixed"])
def test_two_ranks_answer_as_one(local, layout, tmp_path):
    """Sequences that join and leave a batch of 3 on 2 ranks get their 1-rank answers; with replicated attention
    each stays on the rank that holds its cache rows while others come and go (`moe.engine.rows`)."""
    if layout[-1:] == ["mixed"]:
        (tmp_path / "mixed.json").write_text(json.dumps(MIXED))
        layout = ["--placement", str(tmp_path / "mixed.json")]
    jobs = [(PROMPTS[i % len(PROMPTS)], 4 + 3 * i, 0.0 if i % 3 else 0.8, i) for i in range(7)]
    with Server(TRAINED, "--gpus", "2", "--max-num-seqs", "3", *layout) as server:
        client = server.client()

        def ask(job):  # every other one echoes its prompt, scored on the ranks
            prompt, n, temperature, seed = job
            c = client.completions.create(model="tiny-moe-austen-bbe", prompt=prompt, max_tokens=n,
                                          temperature=temperature, seed=seed, echo=seed % 2 == 1,
                                          logprobs=1 if seed % 2 else None).choices[0]
            return c.text, c.logprobs.token_logprobs[1:] if c.logprobs else None

        with ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(ask, jobs))
        assert server.stop() == 0
    for (text, scores), (p, n, t, s) in zip(got, jobs, strict=True):
        want = local.generate(p, max_new_tokens=n, temperature=t, seed=s, prompt_logprobs=1 if s % 2 else None)[0]
        assert text == (p if s % 2 else "") + str(want)
        if s % 2:
            assert scores[:len(want.prompt_logprobs) - 1] == pytest.approx([e.logprob for e in
                                                                             want.prompt_logprobs[1:]], abs=1e-4)


def test_the_serving_pages_curl_and_client_examples(server):
    from tests.readme_blocks import ROOT, blocks

    page = ROOT / "docs" / "serving.md"
    curl = next(b for b in blocks("bash", page) if b.startswith("curl")).replace("8000", str(server.port))
    done = subprocess.run(curl, shell=True, capture_output=True, text=True, timeout=120)
    assert json.loads(done.stdout)["choices"][0]["finish_reason"] == "length"
    (client_example,) = blocks("py", page)
    script = client_example.replace("8000", str(server.port)).replace('model="tiny-moe-austen-bbe"', 'model="austen"')
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "completion_tokens=16" in done.stdout, done.stderr


@pytest.mark.parametrize("ranks", [[], ["--gpus", "2", "--device", "cpu"]], ids=["1-rank", "2-ranks"])
def test_sequences_whose_kv_cache_cannot_fit_are_refused_at_start_in_one_line(ranks, tmp_path):
    """Each running sequence has a cache row of --max-model-len: 64 of 10^8 positions need terabytes, refused
    before any is taken (a server that started would die under load); from rank processes too, as one line."""
    from tests.test_chat_template import tokenizer_dir

    path = tokenizer_dir(write_checkpoint(tmp_path / "ckpt", tiny_config(vocab_size=300, max_seq_len=10**8)))
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "serve.py"), "--ckpt", str(path), "--port",
                           str(free_port()), "--max-num-seqs", "64", "--max-model-len", str(10**8), *ranks],
                          capture_output=True, text=True, timeout=300)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert last.startswith("error: a KV cache for 64 sequence(s) of 100000000 positions needs ") and \
        last.endswith("free; lower --max-model-len or --max-num-seqs"), last


def test_under_torchrun_rank_zero_serves_and_sigterm_stops_all():
    """torchrun passes SIGTERM to its ranks (and then reports the signal as its own failure: exit 1)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(ROOT / "scripts" / "serve.py"), "--ckpt", str(TRAINED), "--port", str(port)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            return False

    try:
        wait_until(up, 240, "the torchrun server's /health to say 200")
        got = httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0},
                         timeout=120).json()
        with MoEModel.from_pretrained(TRAINED) as model:
            assert got["choices"][0]["text"] == str(model.generate([PROMPTS[0]], max_new_tokens=8)[0])
        workers = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                             text=True).stdout.split()]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        wait_gone(workers)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_serving_bench_reports_vllms_figures_for_each_level(tmp_path):
    out = tmp_path / "serve.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_serve.py"), "--ckpt", str(TRAINED),
                           "--threads", "2", "--concurrency", "1,2", "--requests", "2", "--input-len", "8",
                           "--output-len", "4", "--turns", "2", "--json", str(out)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    for name, level in ((f"ours x1 c={level}", level) for level in (1, 2)):  # --compile adds compiled rows alike
        row, rounds = rows[name], 2 if level == 1 else 1  # c=1 in turns with model.generate
        assert row["failed"] == 0 and row["requests"] == 2 * rounds and len(row["rounds"]) == rounds
        assert row["output_tokens_per_s"] > 0
        assert row["ttft_ms"]["median"] > 0 and row["tpot_ms"]["p99"] >= row["tpot_ms"]["median"]
    assert rows["model.generate c=1"]["output_tokens_per_s"] > 0 and len(rows["model.generate c=1"]["rounds"]) == 2
    assert not [name for name in rows if "compiled" in name]
    assert "TTFT med" in done.stdout and "each round:" in done.stdout
    if sys.platform.startswith("linux"):  # CPU a token by thread: the HTTP thread told apart by its name
        assert set(rows["ours x1 c=1"]["cpu_ms_per_token"]) >= {"http", "load generator"}
        assert rows["model.generate c=1"]["cpu_ms_per_token"] and "ours x1 c=1: CPU a token" in done.stdout
