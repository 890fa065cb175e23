"""Ctrl-C and SIGTERM (preemption) during a run: stop after the current step with a checkpoint, or at once.

`Preemption` installs SIGINT and SIGTERM handlers in the main thread for the duration of a run (the handlers before
it are restored after; in another thread it does nothing, as Python only delivers signals to the main thread). With
`train.save_on_preempt` (and `train.save`), the first signal only sets `requested` and says so on stderr; the loop
finishes its step, writes its checkpoint and raises `Preempted`. A second signal, or any signal without
`train.save_on_preempt`, raises `Preempted` at once.

`Preempted` is a KeyboardInterrupt, so everything that treats Ctrl-C as a stop treats SIGTERM the same way: the MLflow
run is marked KILLED, Ray shuts down with every process it started, the rollout stream stops. `relax-train` exits
with `Preempted.exit_code` (128 + the signal: 130 for SIGINT, 143 for SIGTERM), as a shell reports a process killed
by that signal.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, Optional, Union

from relax.config.schema import RelaxConfig

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_Handler = Union[Callable[[int, Optional[FrameType]], Any], int, signal.Handlers, None]


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Signalled(KeyboardInterrupt):
    """Signal `signum` stops the process as Ctrl-C does (a KeyboardInterrupt): relax-train exits with `exit_code`,
    128 + the signal (130 for SIGINT, 143 for SIGTERM), as a shell reports a process killed by that signal. Raised as
    it is by a sweep's driver on SIGTERM (each job then stops as a `Preempted` run)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
        # the address of the Ray cluster the run (or the sweep) joined, which keeps running: only the run's own
        # processes stopped; None: Ray was an instance of the run's own, stopped with it (relax-train says which)
        self.joined: Optional[str] = None

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        return f"{signal_name(self.signum)} received"


class Preempted(Signalled):
    """The run was stopped by signal `signum`. `step`: the 0-based index of the last step it trained before stopping
    (None: stopped at once, in the middle of a step) and `checkpointed`, whether that step's checkpoint was written;
    `latest`: the latest committed checkpoint (set by the runner). The message counts steps as the progress line
    (`step 13/30` once 13 are done) and the checkpoint names (`step_000013`) do: after index 12, "13 steps"."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.step: Optional[int] = None
        self.checkpointed = False
        self.latest: Optional[Path] = None

    def __str__(self) -> str:
        name = signal_name(self.signum)
        if self.step is not None:
            steps = f"{self.step + 1} step" + ("s" if self.step else "")
            text = f"{name} received: stopped after {steps} " + \
                ("with a checkpoint" if self.checkpointed else "(its checkpoint could not be written)")
        else:
            text = f"{name} received: stopped at once"
        if self.latest is not None:
            return f"{text}; train.resume=auto continues from {self.latest}"
        return f"{text}; no checkpoint was committed (a new run starts from step 1)"


class Preemption:
    """SIGINT and SIGTERM handlers for the duration of a run (a context manager).

    `save`: the first signal requests a stop after the current step with a checkpoint (`requested`: its number);
    otherwise, or on a second signal, `Preempted` is raised at once. `step`: the 0-based index of the step in
    progress, for the message (which says it 1-based).
    """

    def __init__(self, save: bool, waits: Optional[str] = None):
        """`waits`: what finishing the step waits for beyond the step's own work, said with the first signal (the
        agent runs in flight, up to their time limit), else None."""
        self.save, self.waits = save, waits
        self.requested: Optional[int] = None
        self.step: Optional[int] = None
        self.raised: Optional[int] = None  # the signal whose handler raised Preempted (a stop at once)
        self._previous: dict[int, _Handler] = {}

    @classmethod
    def from_config(cls, cfg: RelaxConfig) -> Preemption:
        """`train.save_on_preempt`, when the run writes checkpoints (`train.save`); an agent program's runs
        (`data.openai_agent`), which the step waits for up to `data.agent_timeout_s`."""
        d = cfg.data
        waits = (f"its agent runs in flight are waited for, up to data.agent_timeout_s={d.agent_timeout_s:g} s"
                 if d.openai_agent else None)
        return cls(save=bool(cfg.train.save and cfg.train.save_on_preempt), waits=waits)

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.getsignal(signum)
            self.arm()
        return self

    def arm(self) -> None:
        """(Re)install the handlers: `ray.init` installs its own SIGTERM handler in the driver, so the runner arms
        again once Ray is up. Does nothing outside the context or the main thread."""
        if not self._previous or threading.current_thread() is not threading.main_thread():
            return
        for signum in SIGNALS:
            signal.signal(signum, self._handle)

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if not self.save or self.requested is not None:
            self.raised = signum
            raise Preempted(signum)
        self.requested = signum
        name = signal_name(signum)
        # 1-based, as the progress line shows the step once it is done (`step 13/30`) and its checkpoint is named
        where = f"step {self.step + 1}" if self.step is not None else "the current step"
        again = "press Ctrl-C" if signum == signal.SIGINT else f"send {name}"
        waits = f" ({self.waits})" if self.waits else ""
        message = (f"relax-train: {name} received: stopping after {where} with a checkpoint{waits}; {again} again to "
                   "stop now\n")
        # os.write, not print: the handler may run while the main thread is inside a write to sys.stderr
        try:
            fd = sys.stderr.fileno()
            os.write(fd, (("\n" if os.isatty(fd) else "") + message).encode())  # below a live progress line
        except (OSError, ValueError, AttributeError):  # no real stderr (captured, closed)
            pass

    def as_preempted(self, exc: KeyboardInterrupt) -> KeyboardInterrupt:
        """`exc` as the Preempted it is: a signal arriving while Ray's driver blocks in a call (ray.get, ray.wait)
        runs the handler there, and Ray raises a plain KeyboardInterrupt in place of the handler's exception."""
        if isinstance(exc, Preempted) or self.raised is None:
            return exc
        return Preempted(self.raised)

    def stop(self, step: int, checkpointed: bool) -> Preempted:
        """The exception that stops the run after `step` (once `requested`), whose checkpoint was written or not."""
        assert self.requested is not None
        exc = Preempted(self.requested)
        exc.step, exc.checkpointed = step, checkpointed
        return exc
