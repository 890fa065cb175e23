"""Fixtures and helpers of the data tests (`write_jsonl`: `from tests.data.conftest import write_jsonl`)."""

from __future__ import annotations

import json

import pytest

from relax.data.tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
