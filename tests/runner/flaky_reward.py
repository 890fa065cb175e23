"""A user reward function (imported as `flaky_reward:reward`) that raises on some responses."""


def reward(response: str, label: str) -> float:
    if len(response) % 2 == 1:
        raise RuntimeError("this reward function fails on odd-length responses")
    return 1.0 if label in response else 0.0
