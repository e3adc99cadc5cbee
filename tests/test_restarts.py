"""When an engine process that died is started again (`engine_process/restarts.py`): a clock
passed in, no process."""

from __future__ import annotations

from vox_ws.engine_process.restarts import RestartPolicy, Restarts


def test_each_death_waits_twice_as_long_and_too_many_in_the_window_stop_the_restarts():
    restarts = Restarts(RestartPolicy(max_deaths=4, window_s=60.0, first_delay_s=0.5, max_delay_s=3.0))
    assert [restarts.after_death(t) for t in (0.0, 1.0, 2.0)] == [0.5, 1.0, 2.0]
    assert restarts.after_death(3.0) is None and restarts.count == 3
    assert "died 4 times within 60 s" in restarts.why_not()


def test_deaths_out_of_the_window_are_forgotten_and_the_delay_is_capped():
    restarts = Restarts(RestartPolicy(max_deaths=3, window_s=10.0, first_delay_s=1.0, max_delay_s=1.5))
    assert restarts.after_death(0.0) == 1.0
    assert restarts.after_death(5.0) == 1.5                 # 2.0, capped
    assert restarts.after_death(20.0) == 1.0                # the two before are out of the window
    assert restarts.after_death(21.0) == 1.5
    assert restarts.after_death(22.0) is None
