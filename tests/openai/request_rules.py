"""What the request-rule tests (test_request_part_rules.py, test_request_schema_rules.py) share: a structured
output's model, the `client` fixture (the official `openai` client of a scripted gateway that answers ANSWER, with the
gateway as `client.gateway`) and `refused`, a 400 in OpenAI's error shape naming the field."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from pydantic import BaseModel

ANSWER = '{"x": 1}'


class Answer(BaseModel):
    x: int


@pytest.fixture
def client(smol, scripted_gateway) -> openai.OpenAI:
    gw, script, session, client = scripted_gateway(smol, [ANSWER])
    client.gateway = gw
    return client


def refused(call: Any, param: str, code: str | None = None) -> dict:
    """The body of the 400 that `call()` gets, checked to name `param` (and `code` when given) as OpenAI's
    invalid_request_error."""
    with pytest.raises(openai.BadRequestError) as info:
        call()
    body = info.value.body
    assert info.value.status_code == 400 and body["param"] == param and body["type"] == "invalid_request_error", body
    assert code is None or body["code"] == code, body
    return body
