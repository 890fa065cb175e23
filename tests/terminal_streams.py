"""A text stream that says whether it is a terminal, for tests of what the product prints differently on a terminal
than into a file or a pipe (Ray's coloured log prefixes: relax.runner.ray_logs)."""

from __future__ import annotations

import io


class TerminalOrNot(io.StringIO):
    """A StringIO whose isatty() answers `tty`."""

    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty
