"""A reward function for the walk (`data.reward=walk_reward:reward`) that fails on some responses."""


def reward(response: str, label: str) -> float:
    if len(response) % 2 == 1:
        raise RuntimeError("fails on odd-length responses")
    return 1.0 if label in response else 0.0
