"""Stop on SIGTERM or SIGUSR1 at the end of a step, with a checkpoint, and exit with code 5.

Why: Slurm (`scancel`, preemption, `--signal=USR1@<seconds>`) and Kubernetes (pod deletion) send
SIGTERM or SIGUSR1 and allow a grace period before SIGKILL; the default action of those signals
ends a process at once, losing every step since the last interval checkpoint.

How: `StopSignals` replaces the handlers of those signals with one that only records the signal
(a handler that did more could interrupt a checkpoint write or a collective halfway). The loop
asks `agreed()` once per step, right after it: one all-reduce(MAX) of the signal number over the
process group, so every rank stops after the same step even when the signal reached the ranks at
different steps, or only one of them. The trainer then saves that step (when checkpointing is
enabled), skipping any evaluation due at it, and exits with `STOPPED`; rerunning the same command
resumes from that checkpoint. A second signal while saving is recorded and changes nothing (the
save is atomic anyway: `step-N.tmp`, then a rename). Handlers are installed before start-up, so
a signal then is honoured after the first step; they are restored on exit (in-process callers
get theirs back).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

from titan_contrastive.exit_codes import STOPPED

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """Between `install()` and `restore()`, SIGTERM/SIGUSR1 are recorded instead of ending the process."""

    def __init__(self) -> None:
        self.received = 0  # the first stop signal this process got, 0 if none
        self._previous: dict[signal.Signals, object] = {}

    def install(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # Python handles signals in the main thread only
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def restore(self) -> None:
        """The handlers from before `install()` again."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.received = self.received or signum  # no I/O here: the main thread may be inside a write

    def agreed(self) -> signal.Signals | None:
        """The stop signal if any rank got one (collective: every rank calls it after every step)."""
        from titan_contrastive.parallelisms.collectives import (
            max_over_ranks,
        )  # here: the launcher imports this module too

        signum = int(max_over_ranks(float(self.received)))
        return signal.Signals(signum) if signum else None


def stop_message(sig: signal.Signals, step: int, saved: bool) -> str:
    """The log line of a stop: what was saved, and how to go on."""
    if not saved:
        return (
            f"{sig.name}: stopped after step {step}; checkpoint.enable=false, so nothing was saved and a rerun starts "
            f"over (exit code {STOPPED})"
        )
    return (
        f"{sig.name}: stopped after step {step}, checkpoint step-{step} saved; "
        f"rerun the same command to resume (exit code {STOPPED})"
    )
