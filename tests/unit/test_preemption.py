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
