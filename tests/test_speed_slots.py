"""`--slots auto` by measured speed (`engines/speed_slots.py`) as plain data: measures whose times
the test says (a machine's speed and its neighbours are not the test's to know) and a clock the
test moves. No thread, no engine, no sleep. The same with the real Piper worker, measured, is in
test_piper.py; the engine loop running the measures, in test_loop.py."""

from __future__ import annotations

import pytest

from vox_ws.engines.speed_slots import RemeasurePolicy, SpeedMeasure, SpeedSlots


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def half(speed: float) -> tuple[int, str]:
    return max(1, int(speed / 2)), "half of it"


class Machine:
    """What each measure's pieces take: (speech, wall, CPU) seconds, as the test sets them."""

    def __init__(self, piece: tuple[float, float, float] = (4.0, 0.5, 0.5), pieces: int = 2) -> None:
        self.piece = piece
        self.pieces = pieces
        self.spoken = 0

    def __call__(self):
        return [self._speak] * self.pieces

    def _speak(self) -> tuple[float, float, float]:
        self.spoken += 1
        if isinstance(self.piece, Exception):
            raise self.piece
        return self.piece


def sizing(first: tuple[float, float, float], machine: Machine,
           backoff=(30.0, 60.0)) -> tuple[SpeedSlots, Clock]:
    clock = Clock()
    policy = RemeasurePolicy(backoff_s=backoff, clock=clock)
    return SpeedSlots(SpeedMeasure.of(first, threads=1), half, machine, policy, engine="Piper"), clock


def measured(slots: SpeedSlots) -> None:
    for _ in slots.measure():
        pass


def test_a_quiet_start_is_final():
    slots, _ = sizing((8.0, 1.0, 0.98), Machine())
    assert slots.wait_s() is None
    count, reason = slots.slots()
    assert count == 4 and "8.0x" in reason and "measured at start" in reason and "98% of the CPU" in reason
    assert slots.describe() | {"measured_at": 0} == {"speed": 8.0, "cpu_share": 0.98, "contended": False,
                                                      "measured_at": 0, "remeasures": 0, "next_at": None}


def test_a_busy_start_is_kept_and_measured_again_after_its_back_off_then_grows_once_quiet():
    machine = Machine((4.0, 0.25, 0.25))                    # 8 s of speech a second, the CPU all its own
    slots, clock = sizing((2.0, 1.0, 0.3), machine)        # 2x, with 30% of the CPU it asked for
    assert slots.slots()[0] == 1 and "on a busy machine: 30%" in slots.slots()[1]
    assert slots.describe()["contended"] and slots.describe()["next_at"] is not None
    assert slots.wait_s() == 30.0
    clock.now = 29.0
    assert slots.wait_s() == 1.0
    clock.now = 30.0
    assert slots.wait_s() == 0.0
    measured(slots)
    assert machine.spoken == 2 and slots.remeasures == 1
    count, reason = slots.slots()
    assert count == 8 and slots.wait_s() is None and "measured again at" in reason and "set aside" in reason
    assert slots.describe()["contended"] is False and slots.describe()["next_at"] is None


def test_a_quiet_measure_again_shrinks_the_slots_where_the_machine_is_slower_than_the_start_said():
    slots, clock = sizing((8.0, 1.0, 0.5), Machine((1.0, 0.5, 0.5)))    # 8x busy, then 2x quiet
    assert slots.slots()[0] == 4
    clock.now = 30.0
    measured(slots)
    assert slots.slots()[0] == 1 and slots.wait_s() is None


def test_a_machine_that_stays_busy_keeps_the_best_measure_until_the_tries_run_out():
    machine = Machine((2.0, 0.5, 0.2))                      # 4x, with 40% of the CPU
    slots, clock = sizing((2.0, 1.0, 0.3), machine)         # 2x
    clock.now = 30.0
    measured(slots)
    assert slots.slots()[0] == 2 and "the best of 2 measures" in slots.slots()[1]
    assert slots.wait_s() == 60.0                            # the next back-off
    machine.piece = (1.0, 0.5, 0.2)                          # slower still: the best is kept
    clock.now = 90.0
    measured(slots)
    count, reason = slots.slots()
    assert count == 2 and slots.remeasures == 2 and slots.wait_s() is None and "no more tries" in reason
    assert slots.describe()["contended"] and slots.describe()["speed"] == 4.0


def test_a_measure_closed_half_way_counts_for_nothing_and_a_failed_one_is_a_try():
    machine = Machine((4.0, 0.25, 0.25))
    slots, clock = sizing((2.0, 1.0, 0.3), machine)
    clock.now = 30.0
    measure = slots.measure()
    next(measure)
    measure.close()                                          # a stream came
    assert slots.remeasures == 0 and slots.wait_s() == 0.0 and slots.slots()[0] == 1
    machine.piece = RuntimeError("the worker died")
    with pytest.raises(RuntimeError):
        measured(slots)
    assert slots.remeasures == 1 and slots.wait_s() == 60.0 and slots.slots()[0] == 1


def test_the_cpu_share_is_of_what_every_thread_asked_for():
    assert SpeedMeasure.of((8.0, 1.0, 1.0), threads=2).cpu_share == 0.5
    assert SpeedMeasure.of((8.0, 1.0, 2.5), threads=2).cpu_share == 1.0      # clipped
    assert SpeedMeasure.of((8.0, 0.0, 0.0), threads=1).speed == 0.0
