"""Errors a user can fix (missing weights, unreachable cluster): reported as one message, exit 2."""


class RunError(Exception):
    pass
