"""StopFlag (train/stop.py): one flag, installed once, re-entrant per signal."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from mamba3lite.train.stop import StopFlag


def test_request_keeps_the_first_reason():
    stop = StopFlag()
    assert not stop.is_set()
    stop.request("the time budget")
    stop.request("signal")
    assert stop.is_set() and stop.reason == "the time budget"


def test_installed_sets_the_flag_on_sigterm_and_restores_the_handler(capsys):
    before = signal.getsignal(signal.SIGTERM)
    stop = StopFlag()
    with stop.installed(signal.SIGTERM):
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.is_set() and stop.reason == "signal"
    assert signal.getsignal(signal.SIGTERM) is before
    assert "received SIGTERM: stopping after this step" in capsys.readouterr().out


def test_nested_installs_leave_a_signal_to_the_outermost(capsys):
    before = signal.getsignal(signal.SIGTERM)
    # SIGINT's handler as found: Python's default_int_handler, or SIG_IGN where a shell started the
    # tests in the background (`nohup make test &`), which ignores SIGINT for the job
    sigint_before = signal.getsignal(signal.SIGINT)
    stop = StopFlag(announce=False)
    with stop.installed(signal.SIGTERM, on_exit=signal.SIG_IGN):
        outer = signal.getsignal(signal.SIGTERM)
        with stop.installed():  # SIGTERM is already this flag's; SIGINT is added for the block
            assert signal.getsignal(signal.SIGTERM) is outer
            assert signal.getsignal(signal.SIGINT) == outer  # the flag's handler, as for SIGTERM
        assert signal.getsignal(signal.SIGTERM) is outer  # the inner exit did not undo the outer one
        assert signal.getsignal(signal.SIGINT) is sigint_before
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # on_exit instead of the old handler
    signal.signal(signal.SIGTERM, before)
    assert capsys.readouterr().out == ""


def test_a_second_ctrl_c_interrupts_at_once():
    stop = StopFlag(announce=False)
    with stop.installed(signal.SIGINT):
        signal.raise_signal(signal.SIGINT)
        assert stop.is_set()
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)


def test_off_the_main_thread_nothing_is_installed():
    before = signal.getsignal(signal.SIGTERM)
    seen = []

    def run() -> None:
        with StopFlag().installed():
            seen.append(signal.getsignal(signal.SIGTERM))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen == [before]
