"""The HTTP port over TLS (the gRPC port's certificate, CA and tokens), and 503s with reason
codes and Retry-After when no verify node is reachable."""

import time

import openai
import pytest

from conftest import env, error_of, httpx


def test_tls_with_the_grpc_certificate_and_token():
    url, ca, token = env("SEQUOIA_TLS_URL"), env("SEQUOIA_TLS_CA"), env("SEQUOIA_HTTP_TOKEN")
    client = openai.OpenAI(base_url=url + "/v1", api_key=token, max_retries=0,
                           http_client=httpx.Client(verify=ca, timeout=300))
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt="hello", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens >= 1
    chunks = list(client.completions.create(model=model, prompt="hello", max_tokens=4,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    # Plaintext to the TLS port fails; so does TLS without trusting the CA.
    with pytest.raises(httpx.HTTPError):
        httpx.get(url.replace("https://", "http://") + "/health", timeout=10)
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=10)
    wrong = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0,
                          http_client=httpx.Client(verify=ca))
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_no_reachable_verify_node_is_503_without_addresses():
    url, dead = env("SEQUOIA_ORPHAN_URL"), env("SEQUOIA_DEAD_ADDR")
    # The first health check of the verify nodes runs at start; wait for its verdict.
    deadline = time.monotonic() + 60
    while True:
        r = httpx.get(url + "/health")
        if r.status_code == 503 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r.status_code == 503 and r.json() == {"status": "no_verify_node"}, r.text
    assert int(r.headers["retry-after"]) >= 1
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model="any", prompt="hello", max_tokens=2)
    assert e.value.status_code == 503
    assert int(e.value.response.headers["retry-after"]) >= 1
    err = error_of(e.value)
    assert err["code"] == "no_verify_node" and err["type"] == "server_error"
    assert dead not in e.value.response.text and "127.0.0.1" not in e.value.response.text
