"""A warm interpreter that forks the suite's training processes, so that each starts with torch, transformers and
hftrain already imported (about 10 s of CPU each on the CI's cores, most of a tiny run's cost).

    python tests/warm/zygote.py SOCKET

imports what every entry script imports, then serves requests on the Unix socket SOCKET until its parent (the
pytest process) goes away. A request comes from `tests/warm/start.py`, the program the suite runs in place of
`python <script>` (directly or as the script `accelerate launch` starts on each rank): its argv, environment,
working directory and its standard streams (passed as file descriptors). The zygote forks; the child takes the
request's streams, environment, directory, argv and buffering and runs the script as `__main__` (runpy), then exits
through the interpreter's own shutdown (threads joined, atexit handlers, streams flushed), as a fresh process would.
The zygote reports the child's pid, then its wait status; when the requester goes away first (killed), the child's
process group is killed.

A request whose environment differs from the zygote's in a variable that a library reads once at import (HF_*,
TORCH_*, PYTHON*, ...: `AT_IMPORT`) is refused, and `start.py` then runs the script in a fresh interpreter. What
the zygote's imports printed is written to every child's streams first, so that a run's output is what a fresh
process prints.
"""

from __future__ import annotations

import gc
import io
import json
import os
import select
import signal
import socket
import sys

# environment variables read at import by torch, transformers, huggingface_hub, datasets, tokenizers or Python
AT_IMPORT = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "DATASETS_", "TOKENIZERS_", "TORCH_", "PYTORCH_", "CUDA_",
             "OMP_", "GOMP_", "MKL_", "OPENBLAS_", "PYTHON", "LD_", "USE_", "XDG_", "HOME", "TMPDIR")
# ... but not these: read when a process group is created or CUDA is first asked for (launchers set them), or what
# the child takes from the request itself (the streams' buffering, PYTHONPATH's entries on sys.path)
AT_RUN_TIME = ("TORCH_NCCL_", "PYTORCH_NVML_BASED_CUDA_CHECK", "PYTHONUNBUFFERED", "PYTHONPATH")
# what every run imports, and what many import later: peft (LoRA runs: with bitsandbytes installed, peft imports it
# and it imports torch's inductor, ~9 s), matplotlib (the model card's loss curve)
MODULES = ("hftrain.finetune", "peft", "matplotlib.figure", "matplotlib.ticker")


def import_relevant(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(AT_IMPORT) and not k.startswith(AT_RUN_TIME)}


def send(conn: socket.socket, message: dict) -> None:
    try:
        conn.send(json.dumps(message).encode())
    except OSError:  # the requester is gone
        pass


class Zygote:
    def __init__(self, path: str):
        self.parent = os.getppid()
        self.env = import_relevant(dict(os.environ))
        captured_out, captured_err = io.StringIO(), io.StringIO()
        real_out, real_err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = captured_out, captured_err
        try:
            for name in MODULES:
                __import__(name)
        finally:
            sys.stdout, sys.stderr = real_out, real_err
        self.preamble = captured_out.getvalue(), captured_err.getvalue()
        gc.freeze()  # the imports' objects: not copied by the children's collections, not walked at their exit
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(path)
        self.listener.listen(64)
        self.children: dict[int, socket.socket] = {}  # pid -> the requester's connection
        self.wakeup, self.wakeup_writer = os.pipe()  # a child's exit wakes the loop at once (SIGCHLD)
        os.set_blocking(self.wakeup, False)
        os.set_blocking(self.wakeup_writer, False)
        signal.set_wakeup_fd(self.wakeup_writer)
        signal.signal(signal.SIGCHLD, lambda number, frame: None)

    def serve(self) -> None:
        while os.getppid() == self.parent:
            readable, _, _ = select.select([self.listener, self.wakeup, *self.children.values()], [], [], 1.0)
            for ready in readable:
                if ready is self.wakeup:
                    os.read(self.wakeup, 4096)
                elif ready is self.listener:
                    self.accept()
                else:  # a requester's connection: it only ever closes (killed before its child ended)
                    pid = next(p for p, c in self.children.items() if c is ready)
                    if not ready.recv(16):
                        self.kill(pid)
            self.reap()
        for pid in list(self.children):
            self.kill(pid)

    def accept(self) -> None:
        conn, _ = self.listener.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        request = json.loads(message)
        if len(fds) != 3 or import_relevant(request["env"]) != self.env:
            for fd in fds:
                os.close(fd)
            differ = sorted(set(import_relevant(request["env"]).items()) ^ set(self.env.items()))
            reason = f"environment read at import differs: {sorted({k for k, _ in differ})}"
            print(f"refused {request['argv'][:1]}: {reason}", flush=True)  # the zygote's log
            send(conn, {"refused": reason})
            conn.close()
            return
        pid = os.fork()
        if pid == 0:
            self.become(request, fds, conn)  # never returns
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn
        send(conn, {"pid": pid})

    def kill(self, pid: int) -> None:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None:
                send(conn, {"status": status})
                conn.close()

    def become(self, request: dict, fds: list[int], conn: socket.socket) -> None:
        """In the child: turn into the requested process and run its script; leaves by SystemExit or an exception,
        through the interpreter's shutdown."""
        self.listener.close()
        conn.close()
        for other in self.children.values():
            other.close()
        os.setpgid(0, 0)  # its own group: killed whole (data loader workers included) if the requester is killed
        signal.set_wakeup_fd(-1)
        os.close(self.wakeup)
        os.close(self.wakeup_writer)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        buffering = 0 if request["unbuffered"] else -1
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own streams
        sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=buffering, closefd=False),  # noqa: SIM115
                                      write_through=request["unbuffered"], line_buffering=False)
        sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=buffering, closefd=False),  # noqa: SIM115
                                      write_through=True, line_buffering=True, errors="backslashreplace")
        sys.__stdout__, sys.__stderr__, sys.__stdin__ = sys.stdout, sys.stderr, sys.stdin
        sys.stdout.write(self.preamble[0])
        sys.stderr.write(self.preamble[1])

        def entries(env):
            return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]

        others = [p for p in sys.path[1:] if p not in entries(os.environ)]
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        script = request["argv"][0]
        sys.argv = list(request["argv"])
        sys.orig_argv = list(request["orig_argv"])
        sys.path[:] = [os.path.dirname(os.path.abspath(script)), *entries(os.environ), *others]
        import runpy

        runpy.run_path(script, run_name="__main__")
        sys.exit(0)


if __name__ == "__main__":
    Zygote(sys.argv[1]).serve()
