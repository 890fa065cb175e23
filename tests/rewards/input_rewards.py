"""Reward functions for tests/rewards/test_reward_inputs.py, at module level (pickled by reference to reward workers),
imported as `input_rewards:<name>` (the tests put this directory on sys.path). Each returns verl's dict form, whose
other keys (logged as metrics, `Scores.extras`) say what the function received."""

from __future__ import annotations

import asyncio


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature, as a verl user writes it: data_source and extra_info are the record's fields."""
    return {"score": float(solution_str.strip() == ground_truth), "gsm": float(data_source == "openai/gsm8k"),
            "index": float(extra_info["index"]), "level": float(extra_info.get("level", -1))}


def trl_style(completion, messages, label, **kwargs):
    """TRL's way: the prompt as messages, and every other dataset column as keyword arguments."""
    return {"score": float(completion.strip() == label), "messages": float(len(messages)),
            "user_is_last": float(messages[-1]["role"] == "user" and "repeat" in messages[-1]["content"]),
            "difficulty": float(kwargs["difficulty"]), "columns": float(len(kwargs)),
            "has_prompt_text": float(isinstance(kwargs.get("prompt"), str) and "repeat" in kwargs["prompt"])}


async def async_turns(response: str, label: str, messages: list) -> dict:
    """An async reward asking for the conversation: its assistant and tool messages counted."""
    await asyncio.sleep(0)
    return {"score": 1.0, "assistant": float(sum(m["role"] == "assistant" for m in messages)),
            "tool": float(sum(m["role"] == "tool" for m in messages))}


def needs_difficulty(response: str, label: str, difficulty: int) -> float:
    return float(difficulty)


def maybe_difficulty(response: str, label: str, difficulty: int = 7) -> float:
    return float(difficulty)


def one_parameter(response: str) -> float:
    """No parameter for the label: refused when named."""
    return 0.0


def worker_pid(response: str, label: str) -> dict:
    """Which process made the call (tests/rewards/test_sandbox_options.py counts the reward workers by it)."""
    import os

    return {"score": 1.0, "pid": float(os.getpid())}
