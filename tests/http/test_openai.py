"""The OpenAI-compatible API through the official `openai` client (and httpx where the client
cannot go). Greedy texts are compared with what gRPC `Generate` and the target alone produced
(tests/tests/http_api.rs computes them and checks those two against each other)."""

import re
import time

import openai
import pytest

from conftest import env, error_of, httpx


def chat_args(expected, model, **kw):
    args = dict(model=model, messages=[{"role": "user", "content": expected["chat_prompt"]}],
                max_tokens=expected["max_tokens"], temperature=0, seed=0)
    args.update(kw)
    return args


def scrape(url):
    return httpx.get(url, timeout=30).text


def series(text, name):
    """Sum of every sample of a Prometheus series (all label sets)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_models_lists_the_target_with_the_draft_named(client, expected):
    models = client.models.list().data
    assert [m.id for m in models] == [expected["target_model"]]
    assert models[0].model_extra["sequoia"]["draft_model"]


def test_health_is_open_and_ready(base_url):
    r = httpx.get(base_url + "/health")  # no token: probes carry none
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "ok"}


def test_chat_greedy_equals_grpc_and_target(client, model, expected):
    r = client.chat.completions.create(**chat_args(expected, model))
    print("chat:", r.model_dump_json(indent=1))
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.created > 0
    assert r.model == model
    c = r.choices[0]
    assert c.index == 0 and c.message.role == "assistant"
    assert c.message.content == expected["chat_text"]
    assert c.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= expected["max_tokens"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    spec = r.model_extra["sequoia"]
    assert spec["draft_n"] >= spec["draft_n_accepted"] >= 0
    assert spec["steps"] >= 1 and spec["tokens_per_step"] >= 1
    # The verify node is named, but not by its internal address.
    assert re.fullmatch(r"node-[0-9a-f]{8}", spec["verify_node"]), spec
    assert env("SEQUOIA_VERIFY_ADDR") not in r.model_dump_json()
    assert "127.0.0.1" not in r.model_dump_json()


def test_chat_stream_equals_grpc_with_usage(client, model, expected):
    stream = client.chat.completions.create(
        **chat_args(expected, model), stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected["chat_text"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason in ("stop", "length")
    assert finals[0].model_extra["sequoia"]["steps"] >= 1
    # The usage chunk comes last, without choices.
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    print(f"chat stream: {len(chunks)} chunks, text {text!r}")


def test_chat_stream_without_usage_has_none(client, model, expected):
    chunks = list(client.chat.completions.create(**chat_args(expected, model), stream=True))
    assert all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected["chat_text"]


def test_content_parts_equal_a_string(client, model, expected):
    parts = [{"type": "text", "text": expected["chat_prompt"]}]
    r = client.chat.completions.create(
        **chat_args(expected, model, messages=[{"role": "user", "content": parts}]))
    assert r.choices[0].message.content == expected["chat_text"]


def test_system_message_reaches_the_template(client, model, expected):
    r = client.chat.completions.create(**chat_args(
        expected, model,
        messages=[{"role": "system", "content": "Answer in French only."},
                  {"role": "user", "content": expected["chat_prompt"]}]))
    plain = client.chat.completions.create(**chat_args(expected, model, max_tokens=1))
    # A different prompt (the template puts the system turn first), so a different answer.
    assert r.usage.prompt_tokens != plain.usage.prompt_tokens
    assert r.choices[0].message.content != expected["chat_text"]


def test_completions_raw_greedy_equals_grpc_and_target(client, model, expected):
    r = client.completions.create(model=model, prompt=expected["raw_prompt"],
                                  max_tokens=expected["max_tokens"], temperature=0)
    print("completion:", r.model_dump_json(indent=1))
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == expected["raw_text"]
    assert r.model_extra["sequoia"]["draft_n"] >= 0


def test_completions_stream_equals_grpc(client, model, expected):
    chunks = list(client.completions.create(
        model=model, prompt=expected["raw_prompt"], max_tokens=expected["max_tokens"],
        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected["raw_text"]
    assert chunks[-1].usage.completion_tokens >= 1


def test_max_tokens_and_max_completion_tokens(client, model, expected):
    r = client.chat.completions.create(**chat_args(expected, model, max_tokens=3))
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(**chat_args(expected, model, max_tokens=None),
                                       max_completion_tokens=2)
    assert r.usage.completion_tokens == 2
    r = client.completions.create(model=model, prompt=expected["raw_prompt"], max_tokens=4,
                                  temperature=0)
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"
    assert expected["raw_text"].startswith(r.choices[0].text)


def stop_string(text):
    """A short piece of `text` after its start, and the text before its first occurrence."""
    words = re.findall(r"\w{3,}", text)
    assert len(words) >= 3, f"reference text too short for a stop test: {text!r}"
    stop = words[2][:3]
    return stop, text[: text.index(stop)]


def test_stop_strings(client, model, expected):
    stop, before = stop_string(expected["chat_text"])
    for s in (stop, [stop, "\u2603never"]):
        r = client.chat.completions.create(**chat_args(expected, model, stop=s))
        assert r.choices[0].message.content == before, (s, r.choices[0].message.content)
        assert r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(**chat_args(expected, model, stop=stop),
                                                stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == before
    stop, before = stop_string(expected["raw_text"])
    r = client.completions.create(model=model, prompt=expected["raw_prompt"], stop=stop,
                                  max_tokens=expected["max_tokens"], temperature=0)
    assert r.choices[0].text == before and r.choices[0].finish_reason == "stop"


def test_seeds_reproduce_sampled_text(client, model, expected):
    args = chat_args(expected, model, temperature=1.0, top_p=0.95, seed=1234)
    a = client.chat.completions.create(**args)
    b = client.chat.completions.create(**args)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.model_extra["sequoia"]["seed"] == 1234
    k = client.chat.completions.create(**args, extra_body={"top_k": 1})
    # top_k = 1 leaves only the argmax: the greedy text at any temperature.
    assert k.choices[0].message.content == expected["chat_text"]


def bad_request(call, param, code=None):
    with pytest.raises(openai.BadRequestError) as e:
        call()
    err = error_of(e.value)
    assert e.value.status_code == 400
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["message"]
    if code:
        assert err["code"] == code, err
    return err


def test_invalid_fields_are_400_naming_the_field(client, model, expected):
    chat = lambda **kw: client.chat.completions.create(**chat_args(expected, model, **kw))
    bad_request(lambda: chat(n=2), "n", "unsupported_parameter")
    bad_request(lambda: chat(logprobs=True), "logprobs")
    bad_request(lambda: chat(top_logprobs=2), "top_logprobs")
    bad_request(lambda: chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools")
    bad_request(lambda: chat(response_format={"type": "json_object"}), "response_format")
    bad_request(lambda: chat(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role")
    bad_request(lambda: chat(temperature=2.5), "temperature")
    bad_request(lambda: chat(top_p=1.5), "top_p")
    bad_request(lambda: chat(max_tokens=0), "max_tokens")
    bad_request(lambda: chat(stop=[""]), "stop")
    bad_request(lambda: chat(messages=[]), "messages")
    long = "tree " * (expected["max_context"] * 2)
    err = bad_request(lambda: chat(messages=[{"role": "user", "content": long}]), "messages",
                      "context_length_exceeded")
    assert "context limit" in err["message"]
    bad_request(lambda: client.completions.create(model=model, prompt="x", n=3), "n")
    bad_request(lambda: client.completions.create(model=model, prompt="x", logprobs=2),
                "logprobs")
    bad_request(lambda: client.completions.create(model=model, prompt=long), "prompt",
                "context_length_exceeded")


def test_bad_bodies(raw):
    r = raw.post("/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = raw.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    # Far over the body limit: 413, in OpenAI's shape.
    r = raw.post("/v1/completions", content=b'{"prompt": "' + b"a" * (5 << 20) + b'"}')
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"


def test_tokens_are_required(client, base_url, model, expected):
    wrong = openai.OpenAI(base_url=base_url + "/v1", api_key="not-the-token", max_retries=0)
    for call in (lambda: wrong.models.list(),
                 lambda: wrong.chat.completions.create(**chat_args(expected, model))):
        with pytest.raises(openai.AuthenticationError) as e:
            call()
        assert e.value.status_code == 401
        assert error_of(e.value)["type"] == "authentication_error"
    r = httpx.post(base_url + "/v1/chat/completions", json=chat_args(expected, model))
    assert r.status_code == 401 and "missing bearer token" in r.json()["error"]["message"]
    r = httpx.get(base_url + "/v1/models", headers={"Authorization": "Basic abc"})
    assert r.status_code == 401 and "malformed" in r.json()["error"]["message"]


def test_unknown_model_and_path_are_404(client, raw, expected):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(**chat_args(expected, "gpt-4o"))
    err = error_of(e.value)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    r = raw.get("/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = raw.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_metrics_stay_off_the_public_port(raw):
    assert raw.get("/metrics").status_code == 404


COUNT = "Count from 1 to 1000, separated by commas: 1, 2, 3, 4,"


def test_busy_is_429_and_a_disconnect_frees_the_slot(client, base_url, token, model, expected):
    """One slot (max_sessions = 1, shared with gRPC): a second generation while a stream runs
    is refused with 429 and Retry-After; closing the stream mid-way cancels the generation,
    which frees the slot and the verify node's session."""
    verify_metrics = env("SEQUOIA_VERIFY_METRICS")
    budget = expected["max_context"] - 64
    body = dict(model=model, prompt=COUNT, max_tokens=budget, temperature=0, stream=True)
    before = series(scrape(verify_metrics), "sequoia_generated_tokens_total")
    with httpx.Client(timeout=600, headers={"Authorization": f"Bearer {token}"}) as h:
        with h.stream("POST", base_url + "/v1/completions", json=body) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            got = [next(lines) for _ in range(3)]
            assert all(l.startswith("data: ") or l == "" for l in got), got
            with pytest.raises(openai.RateLimitError) as e:
                client.completions.create(model=model, prompt="x", max_tokens=1)
            assert e.value.status_code == 429
            assert int(e.value.response.headers["retry-after"]) >= 1
            assert error_of(e.value)["code"] == "overloaded"
            assert series(scrape(verify_metrics), "sequoia_active_sessions") == 1
        # The stream is closed here, long before `budget` tokens.
    deadline = time.monotonic() + 120
    while True:
        try:
            client.completions.create(model=model, prompt="x", max_tokens=1)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "the slot was not freed after the disconnect"
            time.sleep(0.2)
    # The verify node sees the session close just after the reply; give it a moment.
    while series(scrape(verify_metrics), "sequoia_active_sessions") != 0:
        assert time.monotonic() < deadline, "the verify session stayed open"
        time.sleep(0.1)
    # The cancelled generation stopped early: the verify node committed far fewer tokens
    # than the budget, and no more once it was gone.
    committed = series(scrape(verify_metrics), "sequoia_generated_tokens_total")
    assert committed - before < budget / 2, (before, committed)
    time.sleep(1.0)
    assert series(scrape(verify_metrics), "sequoia_generated_tokens_total") == committed


def test_metrics(raw, client, model, expected):
    client.chat.completions.create(**chat_args(expected, model, max_tokens=4))
    text = scrape(env("SEQUOIA_DRAFT_METRICS"))
    for name in ("sequoia_spec_decode_num_drafts_total",
                 "sequoia_spec_decode_num_draft_tokens_total",
                 "sequoia_spec_decode_num_accepted_tokens_total",
                 "sequoia_time_to_first_token_seconds_count",
                 "sequoia_inter_token_latency_seconds_count"):
        assert series(text, name) > 0, name
    assert series(text, "sequoia_spec_decode_num_accepted_tokens_per_pos_total") == series(
        text, "sequoia_spec_decode_num_accepted_tokens_total")
    assert re.search(r'sequoia_http_requests_total\{[^}]*route="/v1/chat/completions",'
                     r'status="200"\} [1-9]', text), text
    # The refused calls of test_tokens_are_required are counted too.
    assert re.search(r'sequoia_http_requests_total\{[^}]*status="401"\} [1-9]', text), text
