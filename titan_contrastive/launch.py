"""torchrun, minus the traceback: `python -m titan_contrastive.launch <torchrun args> -m titan_contrastive.train ...`.

Why this exists: when a rank exits non-zero, `torchrun` (`torch.distributed.run.main`, wrapped in
`@record`) prints a long `ChildFailedError` traceback and exits 1, whatever the rank's exit
code was. A config error (the trainer's exit code 2, one `error: ...` line) and a non-finite stop
(exit 3) then look the same, to a person and to a script. This launcher runs the same
`torch.distributed.run.run(args)`, catches the `ChildFailedError`, prints one line about the root
cause (the earliest failure) and exits with that rank's code, so `run_train.sh` returns what the
trainer returned (`exit_codes.EXIT_CODES`; 128+N for a rank killed by signal N, as a shell reports it).

Stopped by the cluster: when the launcher itself gets SIGTERM (scancel, Kubernetes) or SIGUSR1
(Slurm's `--signal=USR1@<seconds>`), torchrun's agent forwards it to the ranks, which finish their
step, save a checkpoint and exit 5 (`components/preemption.py`); the launcher waits for them up to
TITAN_PREEMPT_GRACE_SECONDS (default 120: room for a step and a large save) before SIGKILL, and
exits 5 when every rank did. That wait is torchrun's own `--shutdown-timeout`, which torchrun
applies to the signals it handles (torchrun before torch 2.13 lacks it; there `honour_shutdown_timeout`
applies it), and SIGUSR1 is added to the signals it handles (`handle_stop_signals`). The wait after
a rank *fails* stays TORCH_ELASTIC_SHUTDOWN_TIMEOUT (`honour_shutdown_timeout`), and so does the
wait after other signals (Ctrl-C), so a hung job still ends quickly.
"""

from __future__ import annotations

import os
import signal
import sys

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import PContext, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from titan_contrastive.components.preemption import STOP_SIGNALS
from titan_contrastive.exit_codes import (
    BAD_INPUT,
    BUG,
    COLLECTIVE,
    EXIT_CODES,
    NONFINITE,
    SIGNAL_HINTS,
    STOPPED,
    meaning,
)

PROG = "run_train.sh"
EXPLAINED_BY = {
    BUG: "its traceback",
    BAD_INPUT: "its error line",
    NONFINITE: "its error line",
    COLLECTIVE: "its error line",
    STOPPED: "its last log line",
}  # what the rank printed
GRACE_ENV, GRACE_DEFAULT = "TITAN_PREEMPT_GRACE_SECONDS", 120  # from a stop signal to SIGKILL of the ranks


def summarize(error: ChildFailedError, shown_local_ranks: set[int] | None) -> tuple[int, str]:
    """(exit code, one line) for the root cause of `error`: its earliest failure.

    `shown_local_ranks`: the local ranks whose output reaches the console (None: all of them).
    """
    rank, failure = error.get_first_failure()
    who = f"rank {rank}" if rank == failure.local_rank else f"rank {rank} (local rank {failure.local_rank})"
    if failure.exitcode < 0:  # killed by a signal: report it as a shell would, 128+N
        sig = -failure.exitcode
        code, hint = 128 + sig, SIGNAL_HINTS.get(sig)
        line = (
            f"{who} was killed by {failure.signal_name()} (signal {sig}{'; ' + hint if hint else ''}), exit code {code}"
        )
    else:
        code = failure.exitcode
        line = f"{who} exited with code {code} ({meaning(code)})"
    if shown_local_ranks is not None and failure.local_rank not in shown_local_ranks:
        line += f"; its output is not shown: set LOG_RANK={failure.local_rank} to see it"
    elif code in EXPLAINED_BY:
        line += f"; see {EXPLAINED_BY[code]} above"
    return code, f"{PROG}: {line}"


def shown_ranks(local_ranks_filter: str) -> set[int] | None:
    """torchrun's --local-ranks-filter ("0,1"; "" shows every rank) as a set, None for all."""
    return {int(r) for r in local_ranks_filter.split(",")} if local_ranks_filter else None


def honour_shutdown_timeout(
    seconds: int | None, stop_grace: int, exit_codes: dict[int, int | None] | None = None
) -> None:
    """Make `seconds` the SIGTERM-to-SIGKILL grace that torchrun gives the other ranks after one fails,
    and after a signal other than SIGTERM/SIGUSR1, and `stop_grace` the grace after SIGTERM/SIGUSR1;
    record each rank's exit code in `exit_codes`.

    torchrun's --shutdown-timeout / TORCH_ELASTIC_SHUTDOWN_TIMEOUT reaches only its own signal
    handling: after a worker fails, `PContext.close()` stops the others with its default of 30 s
    (torch 2.13; see pytorch/pytorch#192815), so a rank that ignores SIGTERM (stopped, stuck in the
    kernel, or handling it) would keep the job alive 30 s more. Here --shutdown-timeout is the stop grace
    (see the module docstring), so the signals that do not stop with a checkpoint are capped at
    `seconds` too; torchrun's other explicit timeouts (restarts) are unaffected. `seconds=None`
    keeps torchrun's waits. An older torchrun (torch 2.9-2.12, no --shutdown-timeout) closes the ranks
    after a signal with no timeout at all, from inside its handling of it: a stop signal gets
    `stop_grace` there too. The exit codes tell a stop in which every rank saved (all `STOPPED`)
    from one cut short: torchrun drops them when it was signalled.
    """
    close = PContext.close

    def close_within(self, death_sig=None, timeout=None) -> None:
        if timeout is None:
            handling = sys.exc_info()[1]  # the older agent closes from its `except SignalException`
            stop = isinstance(handling, SignalException) and handling.sigval in STOP_SIGNALS
            timeout = stop_grace if stop else 30 if seconds is None else seconds
        elif death_sig is not None and death_sig not in STOP_SIGNALS and seconds is not None:
            timeout = min(timeout, seconds)
        close(self, death_sig, timeout)
        if exit_codes is not None:
            exit_codes.update({rank: h.proc.poll() for rank, h in getattr(self, "subprocess_handlers", {}).items()})

    PContext.close = close_within


def whole_seconds(env: dict[str, str], name: str, default: int | None) -> int | None:
    """`env[name]` as whole seconds (`default` when unset); ValueError naming the variable when not a number."""
    value = env.get(name, "" if default is None else str(default))
    if value == "" and default is None:
        return None
    if not value.isdigit():
        raise ValueError(f"{PROG}: {name}={value}: must be a whole number of seconds, e.g. {default or 5}")
    return int(value)


def with_stop_signals(signals: str) -> str:
    """torchrun's --signals-to-handle with SIGTERM and SIGUSR1 added (SIGUSR1's default action
    would end the launcher and leave the ranks running unsupervised)."""
    names = [s.strip() for s in signals.split(",") if s.strip()]
    return ",".join(names + [sig.name for sig in STOP_SIGNALS if sig.name not in names])


def handle_stop_signals(args: object) -> None:
    """Have torchrun's agent forward SIGTERM and SIGUSR1 to the ranks: a torchrun with --signals-to-handle
    (torch 2.10 and later) is given them there; an older one handles SIGTERM, SIGINT, SIGHUP and SIGQUIT
    only, by raising its SignalException from a handler: SIGTERM and SIGUSR1 get such a handler here
    (torchrun sets its own for SIGTERM when the ranks start; before that, ours reports the stop)."""
    if hasattr(args, "signals_to_handle"):
        args.signals_to_handle = with_stop_signals(args.signals_to_handle)
        return

    def raise_signal_exception(signum: int, frame: object) -> None:
        raise SignalException(f"process {os.getpid()} got signal {signum}", sigval=signal.Signals(signum))

    for sig in STOP_SIGNALS:
        signal.signal(sig, raise_signal_exception)


def stopped(sig: signal.Signals, exit_codes: dict[int, int | None], grace: int) -> tuple[int, str]:
    """(exit code, one line) after the launcher was stopped by `sig`: STOPPED when every rank stopped
    after a step with its checkpoint; else 128+sig, naming the ranks that did not."""
    if exit_codes and all(code == STOPPED for code in exit_codes.values()):
        return (
            STOPPED,
            f"{PROG}: stopped by {sig.name}: every rank finished its step, exit code {STOPPED} ({EXIT_CODES[STOPPED]})",
        )
    code = 128 + sig
    if not exit_codes:
        return code, f"{PROG}: stopped by {sig.name} before any rank started, exit code {code}"

    def outcome(c: int | None) -> str:  # a Popen return code: negative for a signal
        return "still running" if c is None else f"exited with {c} ({meaning(c)})" if c >= 0 else meaning(128 - c)

    what = ", ".join(f"local rank {rank} {outcome(c)}" for rank, c in sorted(exit_codes.items()) if c != STOPPED)
    hint = (
        f"; if a step and a save take longer than {GRACE_ENV}={grace} seconds, raise it" if sig in STOP_SIGNALS else ""
    )
    return code, f"{PROG}: stopped by {sig.name}, exit code {code}; not stopped after a step: {what}{hint}"


def failure_grace(args: object, env: dict[str, str]) -> int | None:
    """The grace after a rank fails: torchrun's --shutdown-timeout, else TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else
    None (torchrun's own). An older torchrun (the GPU image's torch 2.11) has no --shutdown-timeout at all."""
    given = getattr(args, "shutdown_timeout", None)
    return given if given is not None else whole_seconds(env, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", None)


def main(argv: list[str] | None = None) -> int:
    args = torchrun.parse_args(argv)
    try:
        grace_after_failure = failure_grace(args, dict(os.environ))
        stop_grace = whole_seconds(dict(os.environ), GRACE_ENV, GRACE_DEFAULT)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    exit_codes: dict[int, int | None] = {}
    honour_shutdown_timeout(grace_after_failure, stop_grace, exit_codes)
    args.shutdown_timeout = stop_grace  # torchrun's agent: from forwarding the signal it got to SIGKILL
    handle_stop_signals(args)
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        code, line = summarize(e, shown_ranks(args.local_ranks_filter))
        print(line, file=sys.stderr)
        return code
    except (
        SignalException
    ) as e:  # torchrun itself was told to stop (Ctrl-C, scancel): it forwarded the signal to the ranks
        code, line = stopped(e.sigval, exit_codes, stop_grace)
        print(line, file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
