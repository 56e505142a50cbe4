"""One policy for every bearer token (issue 30): the model workers and the exporter
refuse the same tokens with the same words, naming the place and never the value."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from edgefeed_base.tokens import MIN_TOKEN_CHARS, token_problem
from monitoring.endpoint import EndpointSecurity
from monitoring.exceptions import MonitoringConfigError
from workers.exceptions import WorkerConfigError
from workers.security import TokenAuth


@pytest.mark.parametrize(
    ("token", "expected"),
    [
        ("", "holds no token"),
        ("a" * (MIN_TOKEN_CHARS - 1), f"has {MIN_TOKEN_CHARS - 1} characters; use at least 16"),
        ("two words-0123456789", "one word of printable ASCII"),
        ("é" * 20, "one word of printable ASCII"),
    ],
)
def test_the_workers_and_the_exporter_refuse_the_same_tokens(
    token: str, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    problem = token_problem(token, "the place")
    assert problem is not None and expected in problem
    assert token == "" or token not in problem  # never the value
    if token:
        with pytest.raises(WorkerConfigError, match=expected):
            TokenAuth(SecretStr(token))
    monkeypatch.setenv("EDGEFEED_TEST_TOKEN", token)
    with pytest.raises(MonitoringConfigError, match=expected):
        EndpointSecurity.load(token_env="EDGEFEED_TEST_TOKEN")


def test_a_strong_token_is_accepted_by_both(monkeypatch: pytest.MonkeyPatch) -> None:
    token = "S3cr3t-M4rker-0123456789"
    assert token_problem(token, "x") is None
    TokenAuth(SecretStr(token))
    monkeypatch.setenv("EDGEFEED_TEST_TOKEN", token)
    assert EndpointSecurity.load(token_env="EDGEFEED_TEST_TOKEN").token == token
