"""A stand-in for Ray's job client in relax-submit's tests: nothing is contacted, each submission is recorded."""

from __future__ import annotations


class Jobs:
    """A stand-in for ray.job_submission.JobSubmissionClient: records what is submitted (`submitted`, which each
    test's fixture empties)."""

    submitted: list[dict] = []

    def __init__(self, address):
        self.address = address

    def submit_job(self, **payload):
        Jobs.submitted.append(payload)
        return "job-1"
