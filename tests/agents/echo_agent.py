"""An agent loop for tests (`data.agent=echo_agent:Echo`, with tests/agents on the path, or
`tests.agents.echo_agent:Echo`): one more turn after the first, answered with the digit the model wrote (or `?`), then
the episode ends with a reward of 1 if the model repeated its first digit."""

from __future__ import annotations

from relax.agents.protocol import Reply


class Echo:
    def reset(self, item: dict) -> None:
        self.first: str | None = None

    def turn(self, text: str) -> Reply:
        digits = [c for c in text if c.isdigit()]
        if self.first is None:
            self.first = digits[0] if digits else "?"
            return Reply(messages=[{"role": "user", "content": self.first}])
        return Reply(reward=float(bool(digits) and digits[0] == self.first), done=True, end="env_done")
