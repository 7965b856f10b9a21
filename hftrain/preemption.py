"""Graceful stops: SIGTERM, SIGINT and SIGUSR1 (Slurm's warning before a time limit) request a stop.

The handler only records the request. The loop folds the flag into the collective it already makes
at the start of every optimizer step (the trained-token count), so every rank learns of a signal seen
by any rank at the same step boundary, finishes nothing half-way, saves a checkpoint of the last
completed step and exits with EXIT_PREEMPTED; the main process says so in one line that names the checkpoint and
the command that resumes from it. A second SIGINT (Ctrl-C twice) stops at once.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
from pathlib import Path

import psutil

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again" -- resume with resume_from_checkpoint=latest
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Preempted(Exception):
    """Raised by the loop after the preemption checkpoint is written. `announce`: this process prints the line (the
    main one; every rank stops at the same step with the same checkpoint)."""

    def __init__(self, signal_name: str, step: int, checkpoint: str, announce: bool = True,
                 command: list[str] | None = None):
        self.announce = announce
        resume = shlex.join(resume_command(checkpoint, command if command is not None else launching_command()))
        super().__init__(f"stopped by {signal_name} after step {step}; state saved in {checkpoint}; resume with: "
                         f"{resume}")


def _launcher_words(cmdline: list[str]) -> list[str] | None:
    """The command as a user types it when `cmdline` runs a launcher (`hftrain launch`, `python -m hftrain launch`,
    `accelerate launch`, `torchrun`), else None; an interpreter in front of a console script is left out."""
    for i, part in enumerate(cmdline[:3]):
        if part == "-m" and cmdline[i + 1:i + 3] in (["hftrain", "launch"], ["hftrain.cli", "launch"]):
            return [*cmdline[:i], "-m", "hftrain", *cmdline[i + 2:]]
        name = Path(part).name
        if name == "torchrun" or (name in ("hftrain", "accelerate") and cmdline[i + 1:i + 2] == ["launch"]):
            return [name, *cmdline[i + 1:]]
    return None


def launching_command() -> list[str]:
    """The command that started this run: the outermost launcher among this process's ancestors (`hftrain launch`
    runs `accelerate launch`, which runs torchrun's agent), else this process's own command line as typed."""
    found, process = None, psutil.Process(os.getpid())
    for _ in range(4):
        try:
            process = process.parent()
            words = _launcher_words(process.cmdline()) if process is not None else None
        except psutil.Error:
            break
        if process is None:
            break
        found = words or found
    return found or list(sys.orig_argv)


def resume_command(checkpoint: str, command: list[str]) -> list[str]:
    """`command` with --resume_from_checkpoint `checkpoint` in place of any it had."""
    words, skip = [], False
    for word in command:
        if skip:
            skip = False
        elif word == "--resume_from_checkpoint":
            skip = True
        elif not word.startswith("--resume_from_checkpoint="):
            words.append(word)
    return [*words, "--resume_from_checkpoint", checkpoint]


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

    def votes(self) -> list[int]:
        """One count per SIGNALS entry (1 for the signal received here): summed over the ranks, they name the
        signals that stopped the run wherever they arrived."""
        return [int(self.signal == sig) for sig in SIGNALS]

    @property
    def requested(self) -> bool:
        return self.signal is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal else ""


def signal_names(votes: list[int]) -> str:
    """The names of the signals with a vote (SIGNALS order), e.g. "SIGINT" or "SIGTERM and SIGUSR1"."""
    return " and ".join(sig.name for sig, count in zip(SIGNALS, votes, strict=True) if count) or "a signal"
