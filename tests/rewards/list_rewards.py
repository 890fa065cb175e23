"""Reward functions for tests/rewards/test_reward_list.py, at module level (pickled by reference to reward workers),
imported as `list_rewards:<name>` (the tests put this directory on sys.path)."""

from __future__ import annotations

import asyncio


def first_digit(response: str, label: str) -> float:
    """1 when the response starts with a digit."""
    return 1.0 if response.lstrip()[:1].isdigit() else 0.0


def as_dict(response: str, label: str) -> dict:
    """verl's compute_score form: the score, two numbers to log and a text that is not logged."""
    words = response.split()
    return {"score": 0.25 if label in words else 0.0, "words": float(len(words)), "hit": label in words,
            "note": "text is not a metric"}


def fails_on_x(response: str, label: str) -> float:
    if "x" in response:
        raise ValueError("no x allowed")
    return 1.0


async def async_exact(response: str, label: str, prompt: str = "") -> float:
    await asyncio.sleep(0)
    return 1.0 if response.strip() == label else 0.0


async def async_hang(response: str, label: str) -> float:
    await asyncio.Event().wait()  # never set: the worker's time limit must stop the call
    return 1.0
