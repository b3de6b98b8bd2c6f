"""torchrun, minus the traceback: `python -m titan_contrastive.launch <torchrun args> -m titan_contrastive.train ...`.

Why this exists: when a rank exits non-zero, `torchrun` (`torch.distributed.run.main`, wrapped in
`@record`) prints a 30-45 line `ChildFailedError` traceback and exits 1, whatever the rank's exit
code was. A config error (the trainer's exit code 2, one `error: ...` line) and a non-finite stop
(exit 3) then look the same, to a person and to a script. This launcher runs the same
`torch.distributed.run.run(args)`, catches the `ChildFailedError`, prints one line about the root
cause (the earliest failure) and exits with that rank's code, so `run_train.sh` returns what the
trainer returned (`EXIT_CODES`; 128+N for a rank killed by signal N, as a shell reports it).
"""

from __future__ import annotations

import os
import signal
import sys

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import PContext, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

PROG = "run_train.sh"
# the one list of exit codes (titan_contrastive.train.main returns 0-4; a shell reports 128+N for signal N)
EXIT_CODES = {
    0: "success",
    1: "unexpected error, a bug",
    2: "bad config, data or checkpoint",
    3: "non-finite loss or gradient norm",
    4: "a collective timed out or a peer rank failed",
}
EXPLAINED_BY = {1: "its traceback", 2: "its error line", 3: "its error line", 4: "its error line"}  # what the rank printed
SIGNAL_HINTS = {signal.SIGKILL: "often the out-of-memory killer, see `dmesg`"}


def meaning(code: int) -> str:
    """What an exit code of run_train.sh means, from `EXIT_CODES` (or the signal for 128+N)."""
    if code in EXIT_CODES:
        return EXIT_CODES[code]
    if code > 128:
        try:
            return f"killed by {signal.Signals(code - 128).name}"
        except ValueError:
            return f"killed by signal {code - 128}"
    return "not a code the trainer returns"


def summarize(error: ChildFailedError, shown_local_ranks: set[int] | None) -> tuple[int, str]:
    """(exit code, one line) for the root cause of `error`: its earliest failure.

    `shown_local_ranks`: the local ranks whose output reaches the console (None: all of them).
    """
    rank, failure = error.get_first_failure()
    who = f"rank {rank}" if rank == failure.local_rank else f"rank {rank} (local rank {failure.local_rank})"
    if failure.exitcode < 0:  # killed by a signal: report it as a shell would, 128+N
        sig = -failure.exitcode
        code, hint = 128 + sig, SIGNAL_HINTS.get(sig)
        line = f"{who} was killed by {failure.signal_name()} (signal {sig}{'; ' + hint if hint else ''}), exit code {code}"
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


def honour_shutdown_timeout(seconds: int) -> None:
    """Make `seconds` the SIGTERM-to-SIGKILL grace that torchrun gives the other ranks after one fails.

    torchrun's --shutdown-timeout / TORCH_ELASTIC_SHUTDOWN_TIMEOUT reaches only its own signal
    handling: after a worker fails, `PContext.close()` stops the others with its default of 30 s
    (torch 2.13; see pytorch/pytorch#192815), so a rank that ignores SIGTERM (stopped, stuck in the
    kernel, or handling it) kept the job alive 30 s more. Explicit timeouts passed to `close` are unaffected.
    """
    close = PContext.close

    def close_within(self, death_sig=None, timeout: int = seconds) -> None:
        close(self, death_sig, timeout)

    PContext.close = close_within


def main(argv: list[str] | None = None) -> int:
    args = torchrun.parse_args(argv)
    seconds = args.shutdown_timeout if args.shutdown_timeout is not None else os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    if seconds is not None:
        if not str(seconds).isdigit():
            print(f"{PROG}: TORCH_ELASTIC_SHUTDOWN_TIMEOUT={seconds}: must be a whole number of seconds, e.g. 5", file=sys.stderr)
            return 2
        honour_shutdown_timeout(int(seconds))
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        code, line = summarize(e, shown_ranks(args.local_ranks_filter))
        print(line, file=sys.stderr)
        return code
    except SignalException as e:  # torchrun itself was told to stop (Ctrl-C, scancel): it stopped the ranks
        print(f"{PROG}: stopped by {e.sigval.name}, exit code {128 + e.sigval}", file=sys.stderr)
        return 128 + e.sigval
    return 0


if __name__ == "__main__":
    sys.exit(main())
