"""The rules of `data.sandbox` (the limits of the code_tests rewards' and the python tool's sandbox), of
`data.reward_workers` and of `data.reward_memory_mb` (the reward worker processes' memory: at least the sandbox's
memory floor, which a worker, an interpreter that has imported relax, needs as much as a sandboxed one), reported
with the rest of the config's (`relax.config.validate`): each limit in its range, the memory and wall-clock limits at
least what a sandboxed interpreter needs to start (`MEMORY_FLOOR_MB`, `WALL_FLOOR_S`: below them every program would
fail before its first line; cpu_s, a whole number of seconds, and file_size_mb, which limits only the files a program
writes, need no floor), the CPU limit within the wall-clock one, and each option refused where nothing reads it (no
code_tests reward and no python tool; reward calls that run in the driver or on a service). The time limits of the
reward and the tool are checked against the configured wall-clock limit where they are
(`relax.config.reward_service_rules`, validate's agent rules)."""

from __future__ import annotations

import dataclasses

from relax.algorithms.base import Violation, range_of
from relax.config.reward_service_rules import CODE_TESTS_REWARDS
from relax.config.schema import RelaxConfig, SandboxConfig
from relax.sandbox_limits import (
    MEMORY_FLOOR_MB,
    PYTHON_TOOL,
    WALL_FLOOR_S,
    code_tests_limits,
    python_tool_limits,
)


def reward_specs(reward: object) -> list[str]:
    """`data.reward`'s entries (one or a list), stripped; [] for a malformed list (its own rules name it)."""
    if isinstance(reward, str):
        return [reward.strip()]
    if isinstance(reward, (list, tuple)) and all(isinstance(s, str) for s in reward):
        return [s.strip() for s in reward]
    return []


def sandbox_violations(cfg: RelaxConfig) -> list[Violation]:
    """Every broken rule of `data.sandbox`, `data.reward_workers` and `data.reward_memory_mb` (see the module
    docstring)."""
    d, out = cfg.data, []
    box, default = d.sandbox, SandboxConfig()

    def require(ok: bool, fields: tuple[str, ...] | str, message: str) -> None:
        if not ok:
            out.append(Violation((fields,) if isinstance(fields, str) else tuple(fields), message))

    specs = reward_specs(d.reward)
    code = any(s in CODE_TESTS_REWARDS for s in specs)
    tool = PYTHON_TOOL in d.tools
    in_range = True
    for f in dataclasses.fields(box):
        allowed = range_of(SandboxConfig, f.name)
        value = getattr(box, f.name)
        if allowed is not None and not allowed.admits(value):
            in_range = in_range and f.name not in ("wall_s", "cpu_s")  # (the CPU rule compares those two)
            require(False, f"data.sandbox.{f.name}", allowed.message(f"data.sandbox.{f.name}", value))
        if not (code or tool):
            require(value == getattr(default, f.name), (f"data.sandbox.{f.name}", "data.reward", "data.tools"),
                    f"data.sandbox.{f.name}={value} has no effect: it limits the programs of the code_tests rewards "
                    f"(data.reward=code_tests|code_tests_all) and of the python tool (data.tools=[python]), and "
                    f"data.reward={d.reward} with data.tools={list(d.tools)} runs none")
    if (code or tool) and range_of(SandboxConfig, "memory_mb").admits(box.memory_mb) \
            and box.memory_mb < MEMORY_FLOOR_MB:
        require(False, "data.sandbox.memory_mb",
                f"data.sandbox.memory_mb={box.memory_mb} is below {MEMORY_FLOOR_MB} MB, the least the sandbox "
                "allows: its Python interpreter alone needs about 20 MB of address space to start, so with less every "
                "program fails with a MemoryError before its first line (and every reward or tool call with it); the "
                "floor leaves room for the program")
    if (code or tool) and range_of(SandboxConfig, "wall_s").admits(box.wall_s) and box.wall_s is not None \
            and box.wall_s < WALL_FLOOR_S:
        require(False, "data.sandbox.wall_s",
                f"data.sandbox.wall_s={box.wall_s} is below {WALL_FLOOR_S:g} s, the least the sandbox allows: each "
                "program starts a fresh interpreter and sets up its isolation within that limit, so with less most "
                "programs would be stopped before their first line (a counted time-out, not a verdict on the code)")
    if in_range and box.cpu_s is not None:
        users = [("the code_tests rewards", code_tests_limits(box))] if code else []
        users += [("the python tool", python_tool_limits(box))] if tool else []
        for user, limits in users:
            require(limits["cpu_s"] <= limits["wall_s"], ("data.sandbox.cpu_s", "data.sandbox.wall_s"),
                    f"data.sandbox.cpu_s={box.cpu_s} exceeds the wall-clock limit of the programs of {user} "
                    f"({limits['wall_s']:g} s{'' if box.wall_s is None else ', data.sandbox.wall_s'}): a program is "
                    "stopped at the wall-clock limit first, so the CPU limit would never act; lower data.sandbox.cpu_s "
                    "or raise data.sandbox.wall_s")
    local = [s for s in specs if s != "none" and not s.lower().startswith(("http://", "https://"))]
    in_driver = ("data.reward_timeout_s=null calls them in the driver" if d.reward_timeout_s is None else
                 f"data.reward={d.reward} has no function (a reward service is called from the driver)")
    if d.reward_workers is not None:
        require(d.reward_timeout_s is not None and bool(local), ("data.reward_workers", "data.reward_timeout_s"),
                f"data.reward_workers={d.reward_workers} has no effect: reward worker processes make the calls of "
                f"data.reward's functions under a time limit (data.reward_timeout_s), and {in_driver}")
    memory = d.reward_memory_mb
    if memory is not None and range_of(type(d), "reward_memory_mb").admits(memory):
        # the driver's own memory is never limited: it holds the rollout (and, in process, the model)
        require(d.reward_timeout_s is not None and bool(local), ("data.reward_memory_mb", "data.reward_timeout_s"),
                f"data.reward_memory_mb={memory} has no effect: it limits the reward worker processes, which make the "
                f"calls of data.reward's functions under a time limit (data.reward_timeout_s), and {in_driver}; "
                "the driver's own memory is not limited")
        require(memory >= MEMORY_FLOOR_MB, "data.reward_memory_mb",
                f"data.reward_memory_mb={memory} is below {MEMORY_FLOOR_MB} MB, the least it may be: a reward worker "
                "process is a Python interpreter that has imported relax (about 27 MB of writable memory) before it "
                "loads the function, so with less every call would fail for lack of memory")
    return out
