"""The digits reward, interrupting the run that calls it at a chosen reward call (imported as
`interrupt_rewards:<name>`; it runs in the driver, so `data.reward_timeout_s=null`). Calls are counted from 1 over
the run, per setting (16 calls a step in these tests: rollout_batch_size 4 x n_samples_per_prompt 4); a setting may
end with ":<anything>" (the test's tmp_path) so that two tests of one process count apart.

- `full_disk`: `RELAX_FSIZE` = "<bytes>:<from call>:<until call or ->". At <from call> the actor process (its pid
  from the run's heartbeat board, `relax-heartbeats-*`) may no longer write files beyond <bytes>
  (`RLIMIT_FSIZE`; CPython ignores SIGXFSZ, so a longer write fails with EFBIG, as on a full disk: chmod cannot
  stop root); at <until call> the limit is lifted again.
- `signals`: `RELAX_SIGNAL` = "<INT|TERM>:<call>[,<call>...]": sends that signal to this process (the driver) at each
  of those calls, as Ctrl-C or a scheduler's preemption would.
"""

from __future__ import annotations

import os
import resource
import signal

from relax.rewards.registry import get_reward_fn

_digits = get_reward_fn("digits")
_calls: dict[str, int] = {}  # per setting (one per test)


def _count(spec: str) -> int:
    _calls[spec] = _calls.get(spec, 0) + 1
    return _calls[spec]


def actor_pid() -> int:
    """The pid of the run's actor process, from the heartbeat board of the run (the newest board with an actor)."""
    import ray

    found = []
    for entry in ray.util.list_named_actors(all_namespaces=False):
        name = entry["name"] if isinstance(entry, dict) else entry
        if name.startswith("relax-heartbeats-"):
            try:
                beats = ray.get(ray.get_actor(name).snapshot.remote(), timeout=30)
            except (ValueError, ray.exceptions.RayActorError):  # the board of an earlier run, gone
                continue
            if "actor" in beats:
                found.append((beats["actor"].beat_age_s, beats["actor"].pid))
    assert found, "no heartbeat board with an actor (cluster.heartbeat_timeout_s must be set)"
    return min(found)[1]


def full_disk(response: str, label: str) -> float:
    spec = os.environ.get("RELAX_FSIZE")
    if spec is not None:
        limit, start, until, *_ = spec.split(":")
        call = _count(spec)
        if call == int(start):
            resource.prlimit(actor_pid(), resource.RLIMIT_FSIZE, (int(limit), resource.RLIM_INFINITY))
        elif until != "-" and call == int(until):
            resource.prlimit(actor_pid(), resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    return _digits(response, label)


def signals(response: str, label: str) -> float:
    spec = os.environ.get("RELAX_SIGNAL")
    if spec is not None:
        name, calls, *_ = spec.split(":")
        if _count(spec) in {int(c) for c in calls.split(",")}:
            os.kill(os.getpid(), getattr(signal, f"SIG{name}"))
    return _digits(response, label)
