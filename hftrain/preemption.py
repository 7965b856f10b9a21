"""Graceful stops: SIGTERM, SIGINT and SIGUSR1 (Slurm's warning before a time limit) request a stop.

The handler only records the request. The loop folds the flag into the collective it already makes
at the start of every optimizer step (the trained-token count), so every rank learns of a signal seen
by any rank at the same step boundary, finishes nothing half-way, saves a checkpoint of the last
completed step and exits with EXIT_PREEMPTED. A second SIGINT (Ctrl-C twice) stops at once.
"""

from __future__ import annotations

import signal

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again" -- resume with resume_from_checkpoint=latest
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Preempted(Exception):
    """Raised by the loop after the preemption checkpoint is written."""

    def __init__(self, signal_name: str, step: int, checkpoint: str):
        super().__init__(f"stopped by {signal_name} after step {step}; state saved in {checkpoint}; continue with "
                         "resume_from_checkpoint=latest")


class StopRequest:
    """Records the first stop signal; installed for the duration of training, then restored."""

    def __init__(self):
        self.signal: int | None = None
        self._previous = {}

    def __enter__(self) -> StopRequest:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is Preempted:
            # The launcher SIGTERMs the other ranks as soon as one exits; that must not turn their
            # EXIT_PREEMPTED into -15. SIG_IGN, unlike a Python handler, survives interpreter shutdown.
            for sig in SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.signal == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: the user wants out now
        self.signal = self.signal or signum

    @property
    def requested(self) -> bool:
        return self.signal is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal else ""
