"""User reward functions for the fault tests (imported as `fault_rewards:<name>`)."""

import time


def hangs(response: str, label: str) -> float:
    """Never returns on about a fifth of the responses (a stuck verifier, a deadlock)."""
    if sum(map(ord, response)) % 5 == 0:
        while True:
            time.sleep(3600)
    return 1.0 if label in response else 0.0


def raises(response: str, label: str) -> float:
    """Raises on odd-length responses."""
    if len(response) % 2 == 1:
        raise RuntimeError("this reward function fails on odd-length responses")
    return 1.0 if label in response else 0.0
