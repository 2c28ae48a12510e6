"""Shared fixtures for the HTTP API tests. tests/tests/http_api.rs starts the services and
passes their addresses in SEQUOIA_* variables; these scripts are not meant to run alone."""

import json
import os

import openai
import pytest

# The HTTP library the openai client itself uses (newer releases ship it as httpx2).
try:
    import httpx2 as httpx
except ImportError:
    import httpx


def env(name):
    value = os.environ.get(name)
    if not value:
        pytest.fail(f"{name} is not set: run these through `cargo test -p sequoia-tests --test http_api`")
    return value


@pytest.fixture(scope="session")
def base_url():
    return env("SEQUOIA_HTTP_URL")


@pytest.fixture(scope="session")
def token():
    return env("SEQUOIA_HTTP_TOKEN")


@pytest.fixture(scope="session")
def expected():
    with open(env("SEQUOIA_EXPECTED")) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def client(base_url, token):
    # No retries: a 429 or 503 must reach the test, not be retried away.
    return openai.OpenAI(base_url=base_url + "/v1", api_key=token, max_retries=0, timeout=600)


@pytest.fixture(scope="session")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="session")
def raw(base_url, token):
    """Plain httpx, for what the openai client cannot send (no token, huge bodies, bad paths)."""
    with httpx.Client(base_url=base_url, timeout=600,
                      headers={"Authorization": f"Bearer {token}"}) as c:
        yield c


def error_of(e):
    """The `error` object of an openai APIStatusError, whichever way the client exposes it."""
    body = e.body if isinstance(e.body, dict) else {}
    return body.get("error", body)
