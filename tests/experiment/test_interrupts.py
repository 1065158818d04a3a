"""SIGINT / SIGTERM handling: at once outside a run loop, deferred to the block's end
inside one (a second signal at once), never inside a critical write."""

import os
import signal

import pytest

from pfljax.experiment import interrupts
from pfljax.experiment.interrupts import Interrupted


def test_outside_a_run_loop_a_signal_stops_at_once_with_its_exit_code():
    before = signal.getsignal(signal.SIGINT)  # Python's handler, or SIG_IGN in a background job
    assert before in (signal.default_int_handler, signal.SIG_IGN)
    with interrupts.handled_signals():
        with pytest.raises(Interrupted) as e:
            os.kill(os.getpid(), signal.SIGTERM)
    assert e.value.exit_code == 143 and e.value.name == "SIGTERM" and e.value.round is None
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_inside_a_run_loop_the_first_signal_is_a_request_and_the_second_stops_at_once():
    with interrupts.handled_signals():
        with interrupts.deferred():
            os.kill(os.getpid(), signal.SIGINT)
            assert interrupts.requested() == signal.SIGINT
            with pytest.raises(Interrupted) as e:
                os.kill(os.getpid(), signal.SIGINT)
            assert e.value.exit_code == 130
        assert interrupts.requested() is None


def test_a_critical_write_finishes_before_a_signal_acts():
    done = []
    with interrupts.handled_signals():
        with pytest.raises(Interrupted):
            with interrupts.critical():
                os.kill(os.getpid(), signal.SIGINT)
                done.append("written")
    assert done == ["written"]


def test_without_the_handlers_signals_keep_pythons_behaviour():
    # Python's own SIGINT handler, also where the process started with SIGINT ignored (a job
    # a non-interactive shell sent to the background).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with interrupts.deferred():
                os.kill(os.getpid(), signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_compare_names_the_run_in_flight_and_the_runs_completed():
    summaries = {"fedavg": [{}, {}], "local": [{}]}
    with pytest.raises(Interrupted) as e:
        with interrupts.naming_runs("local seed 1", summaries, [0, 1]):
            raise Interrupted(signal.SIGINT, 3, 5)
    assert e.value.during == "local seed 1"
    assert e.value.completed == ["fedavg seed 0", "fedavg seed 1", "local seed 0"]
