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


PREPARED = []  # filled by `slow_prepare.prepare` in the process that runs it


def _prepare_slowly() -> None:
    time.sleep(1.0)  # longer than the tests' time limit per call
    PREPARED.append(time.time())


def slow_prepare(response: str, label: str) -> float:
    """1.0 once its `prepare` has run in this process (which takes longer than one call may), else 0.0."""
    return 1.0 if PREPARED else 0.0


slow_prepare.prepare = _prepare_slowly


def _prepare_fails() -> None:
    raise RuntimeError("the verifier's model file is missing")


def broken_prepare(response: str, label: str) -> float:
    return 1.0


broken_prepare.prepare = _prepare_fails


def always_fails(response: str, label: str) -> float:
    """Fails every call (a verifier that cannot read the labels, a service refusing the key)."""
    raise RuntimeError("the verifier refuses every response")
