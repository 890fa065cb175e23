"""A 0/1 user reward (imported as `first_digit_reward:reward`): 1 when the response starts with a digit. The tiny
untrained model does so about a quarter of the time, so evaluation sees prompts with some and with no correct
responses."""


def reward(response: str, label: str) -> float:
    text = response.lstrip()
    return 1.0 if text[:1].isdigit() else 0.0
