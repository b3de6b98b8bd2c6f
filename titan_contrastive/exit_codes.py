"""The exit codes of a run, one list for the trainer (`train.main`) and the launcher (`launch.py`);
which error gives which code is `failures.py`.

A person and a script must be able to tell a bad config (fix and rerun) from a non-finite stop
(go back to a checkpoint), a lost peer (rerun) and a preemption (rerun, it resumes): each is its
own code with one `error: ...` line, and only a bug (1) prints a traceback. A shell reports a
process killed by signal N as 128+N.
"""

from __future__ import annotations

import signal

SUCCESS, BUG, BAD_INPUT, NONFINITE, COLLECTIVE, STOPPED = 0, 1, 2, 3, 4, 5
EXIT_CODES = {
    SUCCESS: "success",
    BUG: "unexpected error, a bug",
    BAD_INPUT: "bad config, data or checkpoint",
    NONFINITE: "non-finite loss or gradient norm",
    COLLECTIVE: "a collective timed out or a peer rank failed",
    STOPPED: "stopped by SIGTERM or SIGUSR1 after a step, its checkpoint saved (if enabled); "
    "rerun the same command to resume",
}
SIGNAL_HINTS = {signal.SIGKILL: "often the out-of-memory killer, see `dmesg`"}


def meaning(code: int) -> str:
    """What an exit code of a run means, from `EXIT_CODES` (or the signal for 128+N)."""
    if code in EXIT_CODES:
        return EXIT_CODES[code]
    if code > 128:
        try:
            return f"killed by {signal.Signals(code - 128).name}"
        except ValueError:
            return f"killed by signal {code - 128}"
    return "not a code the trainer returns"
