import os
import signal

import pytest

from hftrain.preemption import StopRequest


def test_signals_are_recorded_and_handlers_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # the first signal is the one reported
        assert stop.requested and stop.name == "SIGUSR1"
    assert signal.getsignal(signal.SIGTERM) is before


def test_second_ctrl_c_interrupts_at_once():
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def test_after_a_preemption_later_signals_are_still_absorbed():
    from hftrain.preemption import Preempted

    with pytest.raises(Preempted):
        with StopRequest():
            raise Preempted("SIGTERM", 3, "out/checkpoint-3")
    os.kill(os.getpid(), signal.SIGTERM)  # would end this test process with the default handler
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_the_resume_command_is_the_launchers_as_typed_with_the_checkpoint():
    from hftrain.preemption import _launcher_words, resume_command, signal_names

    hftrain = ["/venv/bin/python", "/venv/bin/hftrain", "launch", "--config", "r.yaml"]
    assert _launcher_words(hftrain) == ["hftrain", "launch", "--config", "r.yaml"]
    assert _launcher_words(["python3", "-m", "hftrain", "launch", "--preset", "cpu"]) == \
        ["python3", "-m", "hftrain", "launch", "--preset", "cpu"]
    assert _launcher_words(["/venv/bin/python", "/venv/bin/accelerate", "launch", "x.py"]) == \
        ["accelerate", "launch", "x.py"]
    assert _launcher_words(["/venv/bin/python", "-m", "accelerate.commands.launch", "x.py"]) is None  # hftrain's own
    assert _launcher_words(["python", "hftrain/finetune.py", "--config", "r.yaml"]) is None
    assert resume_command("out/checkpoint-9", ["hftrain", "launch", "--resume_from_checkpoint", "out/checkpoint-3",
                                               "--config", "r.yaml", "--resume_from_checkpoint=latest"]) == \
        ["hftrain", "launch", "--config", "r.yaml", "--resume_from_checkpoint", "out/checkpoint-9"]
    assert signal_names([0, 1, 0]) == "SIGINT" and signal_names([2, 0, 1]) == "SIGTERM and SIGUSR1"
