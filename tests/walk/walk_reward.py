"""Reward functions for the walk: `walk_reward:reward` fails on some responses, `walk_reward:always_fails` on
every one."""


def reward(response: str, label: str) -> float:
    if len(response) % 2 == 1:
        raise RuntimeError("fails on odd-length responses")
    return 1.0 if label in response else 0.0


def always_fails(response: str, label: str) -> float:
    raise RuntimeError("fails on every response")
