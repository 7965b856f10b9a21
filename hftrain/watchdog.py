"""Hang detection: a job whose rank is frozen, cut off or stuck stops within `hang_timeout`, naming that rank.

A collective waits for its slowest rank until `ddp_timeout`, which must stay long for start-up (rank 0 tokenizing a
large dataset while the others wait), so a frozen node (SIGSTOP, a lost machine that never closed its sockets, a
partitioned network) or a rank stuck in a kernel would hold the whole job silently for half an hour. Here every rank
runs a `Watchdog` thread, off the training thread, that every `interval` seconds

- publishes a heartbeat into the job's rendezvous store (the TCPStore at MASTER_ADDR:MASTER_PORT that the launcher
  and `init_process_group` already use, whatever the strategy: DDP, FSDP2, DeepSpeed, tp/pp/cp/ep, several nodes):
  a beat counter, and where its training thread is (last finished step, the laps of the step in progress, or a
  window such as evaluation, a checkpoint save or a generation batch, which count as progress);
- reads every other rank's heartbeat and notes, on its own clock (machines' clocks are never compared), when each
  one last changed.

Once this rank has finished its first optimizer step (start-up can take any time), a rank whose heartbeat has not
changed for `hang_timeout` is *silent* (frozen or unreachable), and a rank whose training thread has not moved for
`hang_timeout` outside a window is *stalled*. When the job stands still, the stalled rank that is behind the others
(they have gone on to the next collective and wait for it) is the one named. Every live rank then prints one line
naming the rank(s), their node and host, the last step each rank finished and the last complete checkpoint, and
exits with EXIT_HUNG, so that the launcher (torchrun, Slurm's --kill-on-bad-exit) ends the job. Nothing is saved on
the way out: the last complete checkpoint resumes exactly (`resume_from_checkpoint: latest`).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

EXIT_HUNG = 2  # as any other hftrain error: the job failed, the last checkpoint resumes it
AUTO_FLOOR_SECONDS = 300.0  # hang_timeout unset: at least 5 minutes ...
AUTO_STEP_MULTIPLE = 10  # ... or 10 median steps, whichever is longer


def nccl_environment(hang_timeout: float | None) -> dict[str, str]:
    """What torch's ProcessGroupNCCL offers against hangs (torch_nccl_environment_variables in torch's docs), read
    when the process group is created: tear the process down on an asynchronous NCCL error (3: without aborting the
    communicator, torch's default), and a monitor thread that aborts the process when NCCL's own watchdog thread is
    stuck (a hung CUDA/NCCL call) for longer than the heartbeat timeout. The collective timeout itself stays
    ddp_timeout (start-up)."""
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_ENABLE_MONITORING": "1",
            "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(int(max(hang_timeout or AUTO_FLOOR_SECONDS, 1)))}


def set_nccl_environment(hang_timeout: float | None, environ=os.environ) -> dict[str, str]:
    """Set `nccl_environment` where NCCL is used (CUDA with torch's NCCL backend), leaving any value the user set;
    returns what is in effect. Nothing without NCCL."""
    if not (torch.cuda.is_available() and torch.distributed.is_available() and torch.distributed.is_nccl_available()):
        return {}
    for name, value in nccl_environment(hang_timeout).items():
        environ.setdefault(name, value)
    return {name: environ[name] for name in nccl_environment(hang_timeout)}


@dataclass
class Verdict:
    """Who holds the job up: `kind` "silent" (no heartbeat), "stalled" (behind the others, not moving) or "stuck"
    (every rank stands at the same point)."""

    kind: str
    ranks: list[int]
    seconds: float


def position(record: Mapping) -> tuple[int, int]:
    """How far a rank's training thread got: (finished steps, laps of the step in progress)."""
    return record["step"], record["lap"]


def judge(records: Mapping[int, Mapping], beat_age: Mapping[int, float], progress_age: Mapping[int, float],
          timeout: float, stale: float | None = None) -> Verdict | None:
    """The verdict on the heartbeats seen (`records`, by rank), given for how long each rank's beat and progress
    have not changed (seconds, on the observer's clock); None while nothing is older than `timeout`.

    Ranks that have finished training are never named. A silent rank is named first: the others wait for it.
    Otherwise, once some rank has not moved for `timeout` outside a window, the ranks behind the furthest position are
    named (the others are waiting in the next collective for them), or every rank when all stand at one point (a
    collective that never completes). A named rank whose heartbeat is also older than `stale` (several heartbeat
    intervals: its heartbeat thread, which runs whatever the training thread does, has stopped too) is named
    silent: a frozen process's last beat is a moment younger than its last progress, so its stall is seen first.
    A rank is named stalled only on its own word: its last heartbeat said (`idle`, on its own clock) that its
    training thread had not moved for `timeout`. Positions are sampled once per heartbeat, so a rank that went through
    a slow step, then a few quick ones between two samples, then froze, looks to the others as if it had stood at the
    slow step all along; its own heartbeats never said so, and it is named silent once its beat is stale."""
    live = [r for r in sorted(records) if not records[r]["done"]]
    silent = [r for r in live if beat_age[r] > timeout]
    if silent:
        return Verdict("silent", silent, max(beat_age[r] for r in silent))
    stuck = [r for r in live if progress_age[r] > timeout and not records[r]["window"]]
    if not stuck:
        return None
    front = max(position(records[r]) for r in live)
    behind = [r for r in live if position(records[r]) < front]
    named = behind or live
    frozen = [r for r in named if stale is not None and beat_age[r] > stale]
    if frozen:
        return Verdict("silent", frozen, max(beat_age[r] for r in frozen))
    if any(records[r]["idle"] < timeout for r in named):
        return None  # its next heartbeat says so, or its silence names it
    kind = "stalled" if behind or len(live) == 1 else "stuck"  # one rank left: nobody else to wait for
    return Verdict(kind, named, max(progress_age[r] for r in stuck))


def describe(verdict: Verdict, records: Mapping[int, Mapping], timeout: float, checkpoint: Path | None,
             output_dir: Path, own_rank: int) -> str:
    """The one line every live rank prints before it exits."""
    def who(r):
        rec = records[r]
        return f"rank {r} (node {rec['node']}, host {rec['host']})"

    names = ", ".join(who(r) for r in verdict.ranks)
    first = records[verdict.ranks[0]]
    where = (f"in {first['window']}" if first["window"] else
             f"in training step {first['step'] + 1}" + (f" after {first['where']}" if first["where"] else ""))
    if verdict.kind == "silent":
        what = (f"{names} sent no heartbeat for {verdict.seconds:.0f}s: frozen, its machine lost or the network to it "
                "cut")
    elif verdict.kind == "stalled":
        waiting = " while the other ranks wait for it" if len(records) > 1 else ""
        what = (f"{names} made no progress for {verdict.seconds:.0f}s {where}{waiting}: a hung kernel or device, a "
                "deadlock in a data worker, a stuck input")
    else:
        what = (f"every rank ({names}) stands still {where} for {verdict.seconds:.0f}s: a collective that does not "
                "complete (network), or every rank hung at once")
    steps = ", ".join(f"{r}: {records[r]['step']}" for r in sorted(records))  # as last heard from each
    saved = (f"last complete checkpoint {checkpoint} (continue with resume_from_checkpoint=latest, on these or other "
             "nodes)" if checkpoint else f"no complete checkpoint in {output_dir} (the run restarts from step 0)")
    return (f"hftrain: error: hang detected by rank {own_rank}: {what} (hang_timeout {timeout:.0f}s). Last finished "
            f"step heard from each rank: {steps}; {saved}. Stopping the job.")


def heartbeat_interval(timeout: float | None) -> float:
    """Seconds between heartbeats: a tenth of hang_timeout, within [0.2, 5]."""
    return min(max((timeout or AUTO_FLOOR_SECONDS) / 10, 0.2), 5.0)


class Watchdog:
    """One rank's hang watchdog (module docstring). The training thread tells it where it is: `lap` (the step
    timer's laps), `step_done`, `window` (evaluation, checkpoint, generation); `watching` runs it over the
    training loop. `metrics` gives each rank's heartbeat lag for the metrics row."""

    def __init__(self, connect, rank: int, world: int, node: int, timeout: float | None, output_dir: Path,
                 latest_checkpoint, key_prefix: str = "hftrain/heartbeat", interval: float | None = None):
        """`connect()`: a store client (called again after a failed exchange: a timed-out client is not reused);
        `latest_checkpoint(output_dir)`: the last complete checkpoint or None; `timeout` None: automatic."""
        self.connect, self.store = connect, None
        self.rank, self.world, self.node = rank, world, node
        self.fixed_timeout = timeout
        self.output_dir, self.latest_checkpoint = output_dir, latest_checkpoint
        self.keys = [f"{key_prefix}/{r}" for r in range(world)]
        self.interval = interval or heartbeat_interval(timeout)
        self.record = {"rank": rank, "node": node, "host": socket.gethostname(), "beat": 0, "step": 0, "lap": 0,
                       "where": "", "window": "", "done": False, "idle": 0.0}
        self.moved = time.monotonic()  # when this rank's training thread last moved
        self.armed = False
        self.step_times: deque[float] = deque(maxlen=101)
        self.last_step_at: float | None = None
        self.seen: dict[int, dict] = {}
        self.beat_seen: dict[int, float] = {}
        self.moved_seen: dict[int, float] = {}
        self.store_ok = time.monotonic()
        self.lags: dict[int, float] = {}
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        # two threads: the courier exchanges heartbeats with the store (a call may block while the store's host is
        # frozen), the judge decides from what was heard, whether or not the courier is stuck
        self.courier = threading.Thread(target=self._exchange, name="hftrain-heartbeat", daemon=True)
        self.thread = threading.Thread(target=self._judge, name="hftrain-watchdog", daemon=True)
        try:
            self._publish()  # the peers see this rank from its first exchange on
        except Exception:  # noqa: BLE001 - the thread connects again; only a store silent for hang_timeout counts
            self.store = None

    @classmethod
    def for_run(cls, accelerator, recipe, latest_checkpoint, environ: Mapping[str, str] = os.environ) -> Watchdog:
        """This rank's watchdog: the job's rendezvous store with several processes (a client connection of its own,
        so that a store call never waits behind the process group's), an in-process store with one."""
        world, rank = accelerator.num_processes, accelerator.process_index
        per_node = int(environ.get("LOCAL_WORLD_SIZE", world))
        node = int(environ.get("GROUP_RANK", rank // max(per_node, 1)))
        if recipe.hang_timeout == 0:
            return Unwatched()
        interval = heartbeat_interval(recipe.hang_timeout)
        if world > 1:
            def connect():
                return torch.distributed.TCPStore(environ["MASTER_ADDR"], int(environ["MASTER_PORT"]),
                                                  is_master=False, timeout=timedelta(seconds=max(2 * interval, 1)),
                                                  wait_for_workers=False)
            prefix = (f"hftrain/heartbeat/{environ.get('TORCHELASTIC_RUN_ID', '')}/"
                      f"{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        else:
            local = torch.distributed.HashStore()
            connect, prefix = (lambda: local), "hftrain/heartbeat"
        return cls(connect, rank, world, node, recipe.hang_timeout, Path(recipe.output_dir), latest_checkpoint,
                   prefix, interval)

    # -------------------------------------------------------------------------------- the training thread
    def lap(self, name: str) -> None:
        """The step in progress passed a lap of the step timer (data_wait, token_sync, forward, ...)."""
        with self.lock:
            self.record.update(lap=self.record["lap"] + 1, where=name)
            self.moved = time.monotonic()

    def step_done(self, step: int) -> None:
        now = time.monotonic()
        with self.lock:
            self.record.update(step=step, lap=0, where="")
            self.moved = now
            if self.last_step_at is not None:
                self.step_times.append(now - self.last_step_at)
            self.last_step_at = now
            self.armed = True

    @contextmanager
    def window(self, name: str):
        """A stretch without step laps that counts as progress however long it takes (evaluation, a checkpoint save,
        a generation batch); a frozen rank is still found by its silence."""
        with self.lock:
            outer, self.record["window"] = self.record["window"], self.record["window"] or name
        try:
            yield
        finally:
            with self.lock:
                self.record["window"] = outer
                self.moved = time.monotonic()
                self.last_step_at = None if self.last_step_at is None else self.moved  # not a step's time

    @contextmanager
    def watching(self):
        """Run the watchdog over the training loop; on the way out this rank says it is done (never named)."""
        with self.lock:
            self.last_step_at = self.moved = self.store_ok = time.monotonic()  # step 1's time counts (warm-up)
        self.courier.start()
        self.thread.start()
        try:
            yield self
        finally:
            with self.lock:
                self.record["done"] = True  # the courier's last heartbeat says so
            self.stopped.set()
            self.thread.join(timeout=10)
            self.courier.join(timeout=2 * self.interval + 1)  # not forever: the store may be gone with a peer

    @property
    def timeout(self) -> float:
        """hang_timeout, or unset: the larger of AUTO_FLOOR_SECONDS and AUTO_STEP_MULTIPLE median steps."""
        if self.fixed_timeout:
            return self.fixed_timeout
        median = statistics.median(self.step_times) if self.step_times else 0.0
        return max(AUTO_FLOOR_SECONDS, AUTO_STEP_MULTIPLE * median)

    def metrics(self) -> dict[str, float]:
        """The largest heartbeat lag of each rank since the last call (seconds since its heartbeat last changed, on
        this rank's clock: about `interval` when healthy; a rank nearing `hang_timeout` is about to be named)."""
        now = time.monotonic()
        with self.lock:
            lags, self.lags = self.lags, {}
            for r, seen in list(self.beat_seen.items()):
                lags[r] = max(lags.get(r, 0.0), now - seen if r != self.rank else 0.0)
        return {"hang_timeout": round(self.timeout, 1),
                **{f"rank{r}/heartbeat_lag": round(lag, 3) for r, lag in sorted(lags.items())}}

    # ------------------------------------------------------------------------------------- its own thread
    def _publish(self, now: float | None = None) -> None:
        with self.lock:
            self.record["beat"] += 1
            now = time.monotonic() if now is None else now
            self.record["idle"] = round(now - self.moved, 3)  # its training thread, on its own clock
            payload = json.dumps(self.record)
        self.store = self.store or self.connect()
        self.store.set(self.keys[self.rank], payload)

    def _read(self) -> dict[int, dict]:
        found = {}
        for r, key in enumerate(self.keys):
            if r == self.rank:
                continue
            if r in self.seen or self.store.check([key]):
                found[r] = json.loads(self.store.get(key))
        return found

    def _observe(self, now: float) -> None:
        """One exchange with the store: publish this rank's heartbeat, read the others'."""
        try:
            self.store = self.store or self.connect()
            self._publish(now)
            records = self._read()
        except Exception:  # noqa: BLE001 - a store that does not answer: its host is judged by the time it stays so
            self.store = None
            return
        self.store_ok = now
        with self.lock:
            records[self.rank] = dict(self.record)
            for r, rec in records.items():
                before = self.seen.get(r)
                if before is None or before["beat"] != rec["beat"]:
                    self.beat_seen[r] = now
                if before is None or position(before) != position(rec) or before["window"] != rec["window"]:
                    self.moved_seen[r] = now
                self.seen[r] = rec
            self.moved_seen[self.rank] = self.moved  # this rank's own progress, to the moment
            for r in self.seen:
                self.lags[r] = max(self.lags.get(r, 0.0), now - self.beat_seen[r])

    def check(self, now: float) -> str | None:
        """The line to print when the job is hung, as seen now."""
        with self.lock:  # the training thread appends step times and moves the record meanwhile
            timeout = self.timeout
            if not self.armed:
                return None
            if now - self.store_ok > timeout:
                return self._store_lost(now - self.store_ok, timeout)
            seen = {r: dict(rec) for r, rec in self.seen.items()}
            seen[self.rank] = {**self.record, "idle": now - self.moved}
            beat_age = {r: now - self.beat_seen.get(r, now) for r in seen}
            progress_age = {r: now - self.moved_seen.get(r, now) for r in seen}
        progress_age[self.rank] = now - self.moved  # this rank's own progress, to the moment
        beat_age[self.rank] = 0.0
        # a live rank beats every interval whatever its training thread does; half the timeout leaves a loaded
        # machine's late beats far from a frozen rank's (about the timeout when its stall is seen)
        verdict = judge(seen, beat_age, progress_age, timeout, stale=max(3 * self.interval, timeout / 2))
        if verdict is None:
            return None
        return describe(verdict, seen, timeout, self._last_checkpoint(), self.output_dir, self.rank)

    def _last_checkpoint(self) -> Path | None:
        try:
            return self.latest_checkpoint(self.output_dir)
        except OSError:  # e.g. a network filesystem that went with the lost node: the verdict matters more
            return None

    def _store_lost(self, seconds: float, timeout: float) -> str:
        host = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        checkpoint = self._last_checkpoint()
        saved = (f"last complete checkpoint {checkpoint}" if checkpoint else
                 f"no complete checkpoint in {self.output_dir}")
        return (f"hftrain: error: hang detected by rank {self.rank}: the job's rendezvous store at {host} did not "
                f"answer for {seconds:.0f}s: the machine that hosts it (node 0's launcher under a static rendezvous) "
                f"is frozen, lost or cut off (hang_timeout {timeout:.0f}s). This rank finished step "
                f"{self.record['step']}; {saved}. Stopping the job.")

    def _exchange(self) -> None:
        while not self.stopped.wait(self.interval):
            self._observe(time.monotonic())
        try:
            self._publish()  # the last heartbeat: done (a rank that left the loop is never named)
        except Exception:  # noqa: BLE001 - the store may be gone with a failed peer: nothing waits on this
            pass

    def _judge(self) -> None:
        try:
            while not self.stopped.wait(self.interval):
                line = self.check(time.monotonic())
                if line is not None and not self.stopped.is_set():
                    self._stop_job(line)
        except Exception as exc:  # noqa: BLE001 - training goes on without it, said once (collectives: ddp_timeout)
            print(f"hftrain: warning: rank {self.rank}'s hang watchdog stopped ({type(exc).__name__}: {exc}); hangs "
                  "now wait for ddp_timeout", file=sys.stderr, flush=True)

    def _stop_job(self, line: str) -> None:
        """Print the verdict and leave at once: the training thread may be blocked in a collective or a kernel that
        no exception can interrupt, and a checkpoint written now could hold a half-finished step."""
        sys.stdout.flush()
        os.write(2, ("\n" + line + "\n").encode())  # on a line of its own, after a progress bar's
        os._exit(EXIT_HUNG)


class Unwatched:
    """hang_timeout 0: no watchdog (collectives wait until ddp_timeout)."""

    def lap(self, name: str) -> None:
        pass

    def step_done(self, step: int) -> None:
        pass

    @contextmanager
    def window(self, name: str):
        yield

    @contextmanager
    def watching(self):
        yield self

    def metrics(self) -> dict[str, float]:
        return {}
