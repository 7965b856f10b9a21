"""`python tests/warm/start.py SCRIPT ARGS...`: run SCRIPT as `python SCRIPT ARGS...` would, in a child forked by the
suite's warm interpreter (tests/warm/zygote.py, at the Unix socket $HFTRAIN_TEST_ZYGOTE), or in a fresh interpreter
(exec) when there is none or it refuses the request (an environment read at import that differs from its own).

This process stays as the run's stand-in: it exits with the child's exit status (or dies of its signal), passes on
the signals a launcher or a test sends it (SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2, SIGCONT), and if it is killed
the zygote kills the child. Only the standard library is imported here.
"""

import io
import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT)


def fresh(argv: list[str]) -> None:
    flags = ["-u"] if unbuffered() else []
    os.execv(sys.executable, [sys.executable, *flags, *argv])


def unbuffered() -> bool:
    """Whether this interpreter runs with -u (torchrun starts its workers so)."""
    return not isinstance(sys.stdout.buffer, io.BufferedWriter)


def main() -> None:
    argv = sys.argv[1:]
    path = os.environ.get("HFTRAIN_TEST_ZYGOTE")
    if not path:
        fresh(argv)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(path)
    except OSError:
        fresh(argv)
    umask = os.umask(0)
    os.umask(umask)
    request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "umask": umask,
               "unbuffered": unbuffered(), "orig_argv": [arg for arg in sys.orig_argv if arg != sys.argv[0]]}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    reply = json.loads(conn.recv(1 << 16) or b'{"refused": "the zygote closed the connection"}')
    if "refused" in reply:
        fresh(argv)
    pid = reply["pid"]
    for number in FORWARDED:
        signal.signal(number, lambda received, frame: os.kill(pid, received))
    message = conn.recv(1 << 16)  # a forwarded signal interrupts it; Python resumes the call (PEP 475)
    status = json.loads(message)["status"] if message else 1 << 8  # the zygote died: a failure
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    sys.stdout.flush()
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    main()
