"""The lowest CPU priority, for work that must never slow the streams: parsing uploads in their
own processes, compiling the step in the background."""

from __future__ import annotations

import os


def lowest_priority() -> str:
    """This process (and the processes and threads it starts, which inherit it) runs only on CPU
    time nothing else wants: SCHED_IDLE on Linux, which runs only where a core would otherwise
    idle; else nice 19, which still takes a share beside busy threads. Returns which it got."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return "SCHED_IDLE"
    except (AttributeError, OSError):
        pass
    try:
        os.nice(19 - os.nice(0))
    except OSError:
        return "unchanged"
    return f"nice {os.nice(0)}"
