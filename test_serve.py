"""serve.py: the real server on 127.0.0.1 (a free port), talked to with the official `openai` client, httpx and
lm-evaluation-harness's local-completions; every reply validated as the openai package's types, greedy
completions against sample.py, logprobs against the model's own logits computed here, every bad input's
status and error body, a bounded load test, the signals and the start-up refusals."""
from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

import sample
import train
from inference import batching, harness
from store import rundir
from test_eval import write_tasks
from test_train import corpus, tiny  # noqa: F401  (corpus is a fixture)

REPO = pathlib.Path(__file__).resolve().parent
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def start(run_dir, *extra, env=None) -> tuple[subprocess.Popen, str]:
    """serve.py on a free port: (the process, its base URL), once it says it serves."""
    proc = subprocess.Popen([sys.executable, str(REPO / "serve.py"), "--checkpoint", str(run_dir), "--port", "0", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})
    line = proc.stdout.readline()
    assert line.startswith("serving "), line + proc.stderr.read()
    url = line.split(" at ")[1].split()[0].removesuffix("/v1")
    proc.stdout.readline()  # the curl line
    return proc, url


@pytest.fixture(scope="module")
def learned(corpus, tmp_path_factory):  # noqa: F811
    """A `test`-size run with GPT-2's learned positions (block_size 64), trained for a few steps."""
    run_dir = tmp_path_factory.mktemp("serve") / "learned"
    assert train.main(tiny(run_dir, corpus, "model.alibi_attn=false", "model.embed_norm=false", "training.steps=40",
                           "training.eval_every=40", "checkpoint.every=40")) == 0
    return run_dir


@pytest.fixture(scope="module")
def served(learned):
    proc, url = start(learned, "--api-key", KEY, "--max-queue", "64", "--max-body-bytes", "65536")
    yield url
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1].startswith("error: interrupted: the server at"), err


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(learned):
    return rundir.Run(learned).weights.load_model()[0]


def post(url: str, path: str, body, headers=AUTH) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(url + path, content=content, headers={"Content-Type": "application/json", **headers}, timeout=60)


def valid_completion(body: dict) -> None:
    """body validates as the openai package's Completion, but for two nulls its types do not allow for and OpenAI's
    API itself sends: the first echoed token's logprob (it has no context) and a stream chunk's finish_reason
    before the last chunk."""
    body = json.loads(json.dumps(body))
    for choice in body["choices"]:
        if choice["finish_reason"] is None:
            choice["finish_reason"] = "length"
        lp = choice.get("logprobs")
        if lp and lp["token_logprobs"] and lp["token_logprobs"][0] is None:
            lp["token_logprobs"][0], lp["top_logprobs"][0] = 0.0, {}
    Completion.model_validate(body)


def sample_text(run_dir, prompt: str, new: int, capsys) -> str:
    capsys.readouterr()
    assert sample.main(["--checkpoint", str(run_dir), "--prompt", prompt, "--max-new-tokens", str(new),
                        "--temperature", "0"]) == 0
    return capsys.readouterr().out.split("----------\n", 1)[1].rstrip("\n")


# ----------------------------------------------------------------------------------------------
# The openai client


def test_completions_greedy_is_sample_py_and_validates(learned, served, client, capsys):
    prompt = "the quick"
    reply = client.completions.create(model="learned", prompt=prompt, max_tokens=12, temperature=0)
    raw = post(served, "/v1/completions", {"model": "learned", "prompt": prompt, "max_tokens": 12, "temperature": 0})
    Completion.model_validate(raw.json())
    assert raw.json()["choices"][0]["text"] == reply.choices[0].text
    assert prompt + reply.choices[0].text == sample_text(learned, prompt, 12, capsys)
    assert reply.usage.completion_tokens <= 12 and reply.usage.prompt_tokens == len(
        post(served, "/tokenize", {"prompt": prompt}).json()["tokens"])
    assert reply.choices[0].finish_reason in ("length", "stop")
    models = client.models.list()
    assert [m.id for m in models.data] == ["learned"]


def test_echo_logprobs_are_the_models_log_softmax(served, client, model):
    ids = post(served, "/tokenize", {"prompt": "a dog jumped over the lazy cat"}).json()["tokens"]
    reply = client.completions.create(model="learned", prompt=ids, max_tokens=3, temperature=0, logprobs=3, echo=True)
    lp = reply.choices[0].logprobs
    valid_completion(reply.model_dump())
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.token_logprobs) == len(ids) + 3
    vocab = model.config.vocab_size
    logits = np.asarray(model(jnp.asarray([ids]))[0], np.float64)[:, :vocab]
    expected = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)
    np.testing.assert_allclose(lp.token_logprobs[1:len(ids)], expected[np.arange(len(ids) - 1), ids[1:]], atol=1e-5)
    for t in range(1, len(ids)):  # the three most likely tokens at each prompt position, and the prompt's own token
        top = set(np.argsort(expected[t - 1])[-3:]) | {ids[t]}
        np.testing.assert_allclose(sorted(lp.top_logprobs[t].values()), sorted(expected[t - 1][list(top)]), atol=1e-5)
        assert lp.top_logprobs[t][lp.tokens[t]] == pytest.approx(lp.token_logprobs[t], abs=1e-6)
    # the generated tokens' logprobs continue the same distribution: greedy picks each position's top token
    for t in range(len(ids), len(ids) + 3):
        assert lp.token_logprobs[t] == pytest.approx(max(lp.top_logprobs[t].values()), abs=1e-6)
    assert reply.choices[0].text.startswith("a dog jumped over the lazy cat")
    # text_offset: each token's start in the returned text, for a prompt with a character split over tokens and
    # a special token (the echo is the prompt as sent), in order, the completion's first at the prompt's end
    eot = post(served, "/tokenize", {"prompt": "<|endoftext|>"}).json()["tokens"]
    ids = eot + post(served, "/tokenize", {"prompt": "caf\u00e9 au lait"}).json()["tokens"]
    reply = client.completions.create(model="learned", prompt=ids, max_tokens=3, temperature=0, logprobs=1, echo=True)
    text, offsets = reply.choices[0].text, reply.choices[0].logprobs.text_offset
    sent = post(served, "/detokenize", {"tokens": ids}).json()["prompt"]
    assert sent == "<|endoftext|>caf\u00e9 au lait" and text.startswith(sent)
    assert "\ufffd" in reply.choices[0].logprobs.tokens[:len(ids)]  # a token holds part of a character
    assert offsets == sorted(offsets) and offsets[-1] < len(text) and offsets[len(ids)] == len(sent)
    assert [text[a:b] for a, b in zip(offsets, offsets[1:len(ids)])][:2] == ["<|endoftext|>", "c"]


def test_logprobs_zero_gives_each_new_tokens_logprob_under_the_model(served, client, model):
    """logprobs=0: no alternatives, but each generated token's logprob, the model's log-softmax computed here
    over the prompt and the completion; a completion without logprobs has none."""
    ids = post(served, "/tokenize", {"prompt": "the cat ran"}).json()["tokens"]
    reply = client.completions.create(model="learned", prompt=ids, max_tokens=6, temperature=0, logprobs=0)
    lp = reply.choices[0].logprobs
    n = len(lp.token_logprobs)
    assert n == reply.usage.completion_tokens  # no alternatives: only the chosen token, as OpenAI's logprobs=0
    assert lp.top_logprobs == [{t: x} for t, x in zip(lp.tokens, lp.token_logprobs)]
    seq, expected = list(ids), []  # greedy by recomputation here, each token's log-softmax beside it
    for _ in range(n):
        logits = np.asarray(model(jnp.asarray([seq]))[0, -1], np.float64)[:model.config.vocab_size]
        logp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        seq.append(int(logp.argmax()))
        expected.append(logp.max())
    assert reply.choices[0].text == post(served, "/detokenize", {"tokens": seq[len(ids):]}).json()["prompt"]
    np.testing.assert_allclose(lp.token_logprobs, expected, atol=1e-5)
    plain = client.completions.create(model="learned", prompt=ids, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].text == reply.choices[0].text
    # with echo: the prompt's tokens too, alone (max_tokens 0) and streamed
    echoed = client.completions.create(model="learned", prompt=ids, max_tokens=2, temperature=0, logprobs=0, echo=True)
    lp = echoed.choices[0].logprobs
    assert lp.tokens[len(ids):] == reply.choices[0].logprobs.tokens[:2] and lp.top_logprobs[0] is None
    assert lp.top_logprobs[1:] == [{t: x} for t, x in zip(lp.tokens[1:], lp.token_logprobs[1:])]
    alone = client.completions.create(model="learned", prompt=ids, max_tokens=0, logprobs=0, echo=True)
    parts = list(client.completions.create(model="learned", prompt=ids, max_tokens=0, logprobs=0, echo=True,
                                           stream=True))
    for reply in (alone, *parts):
        valid_completion(reply.model_dump())
    assert alone.choices[0].logprobs.token_logprobs == lp.token_logprobs[:len(ids)]
    assert "".join(c.text for r in parts for c in r.choices) == alone.choices[0].text
    assert [t for r in parts for c in r.choices if c.logprobs for t in c.logprobs.tokens] == lp.tokens[:len(ids)]
    assert [c.finish_reason for r in parts for c in r.choices if c.finish_reason] == ["length"]


def test_streaming_equals_whole_and_chat_streams(served, client):
    whole = client.completions.create(model="learned", prompt="the", max_tokens=20, temperature=0)
    parts = list(client.completions.create(model="learned", prompt="the", max_tokens=20, temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
    for p in parts:
        valid_completion(p.model_dump())
    assert "".join(c.text for p in parts for c in p.choices) == whole.choices[0].text
    assert parts[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.finish_reason for p in parts for c in p.choices if c.finish_reason] == [whole.choices[0].finish_reason]

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the dog"}]
    chat = client.chat.completions.create(model="learned", messages=messages, max_tokens=10, temperature=0)
    ChatCompletion.model_validate(chat.model_dump())
    chunks = list(client.chat.completions.create(model="learned", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    for c in chunks:
        ChatCompletionChunk.model_validate(c.model_dump())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    # the plain template, as docs/serving.md writes it
    rendered = post(served, "/tokenize", {"messages": messages}).json()["tokens"]
    assert rendered == post(served, "/tokenize", {"prompt": "be brief\n\nUser: the dog\nAssistant:"}).json()["tokens"]
    assert chat.usage.prompt_tokens == len(rendered)


def test_n_seed_and_stop(served, client):
    a = client.completions.create(model="learned", prompt="the", max_tokens=15, temperature=1.0, n=3, seed=7)
    b = client.completions.create(model="learned", prompt="the", max_tokens=15, temperature=1.0, n=3, seed=7)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # the same seed, the same samples
    assert len({c.text for c in a.choices}) > 1  # each choice its own draw
    free = client.completions.create(model="learned", prompt="the", max_tokens=30, temperature=0)
    text = free.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    cut = client.completions.create(model="learned", prompt="the", max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
    # usage counts the tokens generated until the stop string was whole, not the rest of the engine's chunk
    pieces = client.completions.create(model="learned", prompt="the", max_tokens=30, temperature=0,
                                       logprobs=0).choices[0].logprobs.tokens  # each token's text (ASCII here)
    assert "".join(pieces) == text
    whole = next(k for k in range(1, len(pieces) + 1) if stop in "".join(pieces[:k]))
    assert cut.usage.completion_tokens == whole < free.usage.completion_tokens
    streamed = client.completions.create(model="learned", prompt="the", max_tokens=30, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.text for p in streamed for c in p.choices) == cut.choices[0].text


def test_a_completion_beside_fifteen_others_is_the_one_alone(served, client):
    prompts = [" ".join(random.Random(i).choice(["the", "dog", "cat", "ran", "over", "a"]) for _ in range(2 + i % 5))
               for i in range(16)]
    alone = [client.completions.create(model="learned", prompt=p, max_tokens=20, temperature=0).choices[0].text
             for p in prompts]
    together = [None] * 16

    def one(i):
        together[i] = client.completions.create(model="learned", prompt=prompts[i], max_tokens=20,
                                                temperature=0).choices[0].text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone


def test_prompts_prefilled_together_are_each_the_one_prefilled_alone(learned, model):
    """Prompts admitted together are prefilled a bucket at a time in one call (here 2 + 1 of 3 prompts, padded
    to width 4): each one's first token, logprobs, echo and top alternatives, and its slot's cache rows, are
    the ones it gets prefilled alone; the call's padding row writes no slot."""
    cfg = rundir.Run(learned).record.config().model
    prompts = [[5, 9, 2], [7, 1, 4, 4, 3, 8, 2, 6, 11, 3], [3, 3]]  # buckets 8, 16, 8
    settings = [dict(temperature=0.0, echo=True, top=5), dict(temperature=0.9, seed=3), dict(temperature=0.0)]

    def admitted(groups):
        engine = batching.Engine(model, cfg, slots=4, context=32, eot_id=None)
        events = [[] for _ in prompts]
        for group in groups:
            engine.admit([(batching.Sequence(prompts[i], 5, events[i].append, **settings[i]), i) for i in group])
        return events, [np.asarray(c) for name in sorted(engine.cache) for c in engine.cache[name]]

    together, cache = admitted([[0, 1, 2]])
    alone, cache_alone = admitted([[0], [1], [2]])
    assert [[e[0] for e in ev] for ev in together] == [["prompt", "tokens"], ["tokens"], ["tokens"]]
    for ev, ev_alone in zip(together, alone):
        for e, e_alone in zip(ev, ev_alone, strict=True):
            assert e[0] == e_alone[0]
            for x, y in zip(e[1:], e_alone[1:], strict=True):
                np.testing.assert_allclose(np.asarray(x, float), np.asarray(y, float), rtol=0, atol=1e-6)
    assert np.isnan(together[0][0][1][0]) and together[0][0][1].shape == (3,)  # the first prompt token has none
    for c, c_alone in zip(cache, cache_alone, strict=True):
        np.testing.assert_allclose(c[:3], c_alone[:3], rtol=0, atol=1e-6)
        assert not np.any(c[3])  # slot 3: no prompt, and the padding row did not write it


# ----------------------------------------------------------------------------------------------
# Bad input: an OpenAI-shaped error, the server still answering

BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 10**12}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "n": 10**6}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "logprobs": 500}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "a", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": [[1, 2], [3, 10**6]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, -3]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [7] * 60, "max_tokens": 10}, 400, "max_tokens"),  # past block_size 64
    ("/v1/completions", {"prompt": "a", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "a", "frequency_penalty": 1}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "a", "n": 100}, 429, None),  # more than --max-queue 64 waiting
    ("/v1/completions", {"prompt": "a" * 70000}, 413, None),  # past --max-body-bytes
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None),
    ("/detokenize", {"tokens": [10**7]}, 400, "tokens"),
    ("/v1/completions", b'{"prompt": "abc \\ud800", "max_tokens": 2}', 400, "prompt"),  # a lone surrogate
    ("/v1/completions", b'{"prompt": ["a", "\\udc00"]}', 400, "prompt[1]"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud83d"}]}', 400,
     "messages[0].content"),
    ("/tokenize", b'{"prompt": "\\ud83d"}', 400, "prompt"),
    ("/nowhere", {}, 404, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}-{b[0]}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_an_openai_error(served, path, body, status, param):
    reply = post(served, path, body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    assert post(served, "/v1/completions", {"prompt": "a", "max_tokens": 2}).status_code == 200


def test_api_key_and_methods(served):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        reply = httpx.get(served + "/health", headers=headers)
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(served + "/v1/completions", headers=AUTH).status_code == 405
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served}/v1", api_key="wrong", max_retries=0).models.list()


def test_load_32_clients_one_leaving_mid_stream(served):
    errors, done = [], []

    def client_work(i):
        try:
            with httpx.Client(headers=AUTH, timeout=120) as c:
                for r in range(3):
                    body = {"prompt": f"the {i} {r}", "max_tokens": 8 + (i + r) % 16, "temperature": 0.7, "seed": i}
                    if (i + r) % 2:
                        with c.stream("POST", served + "/v1/completions", json={**body, "stream": True}) as s:
                            assert s.status_code == 200
                            lines = [x for x in s.iter_lines() if x]
                            assert lines[-1] == "data: [DONE]"
                            for line in lines[:-1]:
                                valid_completion(json.loads(line.removeprefix("data: ")))
                    else:
                        Completion.model_validate(c.post(served + "/v1/completions", json=body).json())
                done.append(i)
        except Exception as e:  # noqa: BLE001  (told below)
            errors.append(repr(e))

    def leaver():
        with httpx.Client(headers=AUTH, timeout=60) as c:
            with c.stream("POST", served + "/v1/completions",
                          json={"prompt": "the", "max_tokens": 60, "stream": True, "temperature": 1}) as s:
                next(s.iter_lines())  # one event, then gone

    threads = [threading.Thread(target=client_work, args=(i,)) for i in range(32)] + [threading.Thread(target=leaver)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(done) == 32, errors[:3]
    for _ in range(50):  # the leaver's slot is freed at the engine's next chunk
        health = httpx.get(served + "/health", headers=AUTH).json()
        if health["active"] == 0 and health["waiting"] == 0:
            break
        time.sleep(0.1)
    assert health == {**health, "status": "ok", "active": 0, "waiting": 0}


# ----------------------------------------------------------------------------------------------
# lm-evaluation-harness's local-completions against the in-process adapter


@pytest.mark.parametrize("tokenized", [True, False])
def test_lm_eval_local_completions_equals_the_in_process_adapter(served, learned, model, tmp_path, monkeypatch,
                                                                 tokenized):
    import lm_eval
    from lm_eval.tasks import TaskManager

    write_tasks(tmp_path, random.Random(5))
    manager = TaskManager(include_path=str(tmp_path))
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    tokenizer = rundir.Run(learned).record.tokenizer()
    local = harness.JaxLM(model, tokenizer, eot_id=tokenizer.token_to_id("<|endoftext|>"), progress=False)
    remote = (f"base_url={served}/v1/completions,model=learned,tokenizer_backend=remote,auth_token={KEY},"
              f"tokenized_requests={tokenized},max_length=64")
    results = {}
    for name, lm, args in (("local", local, None), ("remote", "local-completions", remote)):
        results[name] = lm_eval.simple_evaluate(model=lm, model_args=args, tasks=["tiny_mc", "tiny_lambada"],
                                                task_manager=manager, bootstrap_iters=0, log_samples=True,
                                                random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                                fewshot_random_seed=0)
    for task in ("tiny_mc", "tiny_lambada"):
        ours = [r for s in results["local"]["samples"][task] for r in s["resps"]]
        theirs = [r for s in results["remote"]["samples"][task] for r in s["resps"]]
        assert len(ours) == len(theirs) > 10
        np.testing.assert_allclose([r[0][0] for r in theirs], [r[0][0] for r in ours], rtol=1e-5, atol=1e-5)
        assert [bool(r[0][1]) for r in theirs] == [bool(r[0][1]) for r in ours]
        for metric, value in results["local"]["results"][task].items():
            if metric.startswith(("acc,", "acc_norm,", "perplexity,")):
                assert results["remote"]["results"][task][metric] == pytest.approx(value, rel=1e-4), metric


# ----------------------------------------------------------------------------------------------
# The README's journey, as written


def test_the_readme_serving_commands_and_snippet(learned, tmp_path, capsys):
    """The README's curl line and its openai snippet against a server of the run named as the README's run is
    (`default`), at a free port in place of 8000."""
    from test_readme import SERVED, TEXT, blocks, command_lines

    section = TEXT.split("## Serving")[1].split("\n## ")[0]
    run_dir = tmp_path / "default"
    run_dir.symlink_to(learned)
    proc, url = start(run_dir)
    try:
        (curl,) = [line for lang, body in blocks(section) if lang == "bash" for line in command_lines(body)
                   if line.startswith("curl")]
        done = subprocess.run(curl.replace(SERVED, url), shell=True, capture_output=True, text=True, timeout=60)
        reply = json.loads(done.stdout)
        valid_completion(reply)
        (snippet,) = [body for lang, body in blocks(section) if lang == "python"]
        capsys.readouterr()
        exec(compile(snippet.replace(SERVED, url), "README.md's serving snippet", "exec"), {"__name__": "snippet"})
        printed = capsys.readouterr().out
        assert printed.startswith(reply["choices"][0]["text"] + "\n")  # the same greedy completion, then the chat
        assert len(printed) > len(reply["choices"][0]["text"]) + 1
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == 143


# ----------------------------------------------------------------------------------------------
# Start-up and signals


def test_a_stop_ends_streams_with_an_error_then_one_line(corpus, tmp_path):  # noqa: F811
    """SIGTERM while a long completion streams (an ALiBi run, whose context --context stretches): the stream's
    last events are an error and [DONE], the server says one line, status 143. A prompt past --context: 413."""
    run_dir = tmp_path / "alibi"
    assert train.main(tiny(run_dir, corpus, "training.steps=4")) == 0
    proc, url = start(run_dir, "--slots", "2", "--context", "30000")
    try:
        too_long = post(url, "/v1/completions", {"prompt": [5] * 30001}, headers={})
        assert too_long.status_code == 413 and too_long.json()["error"]["code"] == "prompt_too_large"
        lines = []
        # greedy: the same continuation every time, long past the moment the signal is handled (the stream
        # must end by the stop, checked below); a sampled one may reach its end-of-text token first on a loaded
        # machine
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "the", "max_tokens": 29000,
                                                                  "stream": True, "temperature": 0},
                          timeout=120) as s:
            for line in s.iter_lines():
                if line:
                    lines.append(line)
                    if len(lines) == 2:
                        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "server_stopping"
    assert proc.returncode == 143, err
    assert err.strip().splitlines() == [f"error: stopped by SIGTERM: the server at {url} stopped; 1 completion in "
                                        "flight ended with an error"], err


def test_port_in_use_and_not_a_run_are_one_line(learned, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, str(REPO / "serve.py"), "--checkpoint", str(learned), "--port",
                               str(port)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"error: port {port} on 127.0.0.1 is in use (another server on it?): choose another with --port"]
    done = subprocess.run([sys.executable, str(REPO / "serve.py"), "--checkpoint", str(tmp_path / "none"), "--port",
                           "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"error: run directory {tmp_path / 'none'} not found"]


# ----------------------------------------------------------------------------------------------
# The server's parts in this process: a failed engine, the queue, a client gone, a token's bytes


@pytest.fixture(scope="module")
def parts(learned, model):
    """A Server over an Engine that is not started (nothing compiled), and the run's tokenizer."""
    from inference import openai_api

    cfg = rundir.Run(learned).record.config().model
    tokenizer = rundir.Run(learned).record.tokenizer()

    def make(slots=2, max_queue=4):
        engine = batching.Engine(model, cfg, slots=slots, context=32, eot_id=None, max_queue=max_queue)
        return openai_api.Server(engine, tokenizer, name="learned", step=40, vocab_size=cfg.vocab_size, context=32,
                                 learned_positions=True, eot_id=None)
    return make, tokenizer


def test_a_failed_engine_is_a_503_and_health_says_so(parts):
    from starlette.testclient import TestClient

    from inference import openai_api

    server = parts[0]()
    server.engine.failure = "generation failed: RuntimeError: the device is gone"  # as Engine._loop leaves it
    with TestClient(openai_api.make_app(server)) as http:
        reply = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "generation_failed"
        assert "the device is gone" in reply.json()["error"]["message"]
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"


def test_a_cancelled_completion_gives_up_its_place_in_the_queue(parts):
    engine = parts[0](max_queue=2).engine
    engine.running = True  # takes submissions; no thread runs them
    seqs = [batching.Sequence([1, 2], 4, lambda e: None) for _ in range(2)]
    assert all(engine.submit(s) for s in seqs) and not engine.submit(batching.Sequence([1], 1, lambda e: None))
    engine.cancel(seqs[0])
    assert engine.waiting() == 1 and engine.submit(batching.Sequence([1], 1, lambda e: None))


def test_a_client_gone_is_seen_while_tokens_keep_coming(parts, monkeypatch):
    """A non-streamed completion whose client went away is cancelled within the poll's time even though its
    tokens arrive far more often than that."""
    import asyncio

    from inference import openai_api

    monkeypatch.setattr(openai_api, "DISCONNECT_POLL", 0.05)
    server = parts[0]()
    cancelled = []
    monkeypatch.setattr(server.engine, "cancel", cancelled.append)

    class Gone:
        async def is_disconnected(self):
            return True

    async def scenario():
        seq = batching.Sequence([1], 10**6, lambda e: None)
        choice = openai_api.Choice(server, seq, 0, [], None, None)
        events: asyncio.Queue = asyncio.Queue()

        async def flow():  # a token every millisecond, for ever
            while True:
                events.put_nowait((0, ("tokens", [3], [float("nan")], np.zeros((1, 0)), np.zeros((1, 0)))))
                await asyncio.sleep(0.001)

        feeder = asyncio.ensure_future(flow())
        try:
            await asyncio.wait_for(server.wait_all(Gone(), [choice], events), 5)
        finally:
            feeder.cancel()
        return seq

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(scenario())
    assert len(cancelled) == 1


def test_a_tokens_bytes_are_its_own(parts, tmp_path):
    """Chat logprobs' `bytes`: a byte-level token's own bytes (the piece of a character its byte, not the
    replacement character's), so that a completion's tokens' bytes join into its text's UTF-8; the same for a
    byte-fallback tokenizer's <0xNN> tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    from inference import openai_api

    server = parts[0]()
    text = "caf\u00e9 \u2713 \u00fcber \U0001f600"
    ids = server.encode(text, "prompt")
    assert any("\ufffd" in server.piece(i) for i in ids)  # some token holds part of a character
    assert b"".join(bytes(server.token_bytes(i)) for i in ids) == text.encode()

    vocab = {"<unk>": 0, "\u2581": 1, "a": 2, "b": 3, **{f"<0x{b:02X}>": 4 + b for b in range(256)}}
    fallback = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    fallback.normalizer = normalizers.Replace(" ", "\u2581")
    fallback.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    other = openai_api.Server(server.engine, fallback, name="x", step=0, vocab_size=len(vocab), context=32,
                              learned_positions=True, eot_id=None)
    ids = other.encode(" ab\u00e9", "prompt")
    assert ids == [1, 2, 3, 4 + 0xC3, 4 + 0xA9]  # é as its two bytes' tokens
    assert b"".join(bytes(other.token_bytes(i)) for i in ids) == " ab\u00e9".encode()
