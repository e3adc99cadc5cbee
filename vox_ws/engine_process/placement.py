"""Which CPUs each engine process runs on, where several share a machine: each its own cores,
the server (its event loop, the encoding threads) the rest. SGLang-Omni measured two engine
processes on one GPU under CUDA MPS doing worse than one unless each was pinned to its own cores
(+100 % pinned); one engine process is left where the system puts it.

The CPUs shared out are those this process may run on, as many as the cgroup's CPU quota allows
(`engines/cpus.py`: a container limited to 4 CPUs of a 96-CPU node shares out 4), or what
`--engine-cpus` says by hand ("0-3;4-7": one list per engine process).
"""

from __future__ import annotations

import os

from ..engines.cpus import cpu_limit


def parse_cpu_lists(text: str) -> list[tuple[int, ...]]:
    """`--engine-cpus`: "0-3;4-7" (one list per engine process, `;` between them; within one,
    `,` between numbers and ranges). ValueError for anything else."""
    lists = []
    for part in text.split(";"):
        cpus: list[int] = []
        for item in part.split(","):
            item = item.strip()
            if not item:
                continue
            first, dash, last = item.partition("-")
            if not first.isdigit() or (dash and not last.isdigit()):
                raise ValueError(f"--engine-cpus {text!r}: {item!r} is no CPU number or range")
            low, high = int(first), int(last) if dash else int(first)
            if high < low:
                raise ValueError(f"--engine-cpus {text!r}: {item!r} runs backwards")
            cpus.extend(range(low, high + 1))
        if not cpus:
            raise ValueError(f"--engine-cpus {text!r}: an engine process with no CPU")
        lists.append(tuple(dict.fromkeys(cpus)))
    return lists


def usable_cpus() -> list[int]:
    """The CPUs to share out: this process's, no more than its cgroup's quota."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    return cpus[:cpu_limit()]


def share(cpus: list[int], engines: int) -> tuple[list[int] | None, list[tuple[int, ...]] | None]:
    """(the server's CPUs, each engine process's): nothing pinned (None, None) for one engine
    process, or with fewer CPUs than engine processes and the server; else about as many for
    the server as for each engine, the server taking what does not divide."""
    if engines < 2 or len(cpus) < engines + 1:
        return None, None
    server = max(1, round(len(cpus) / (engines + 1)))
    each = (len(cpus) - server) // engines
    pinned = [tuple(cpus[i * each:(i + 1) * each]) for i in range(engines)]
    return cpus[engines * each:], pinned


def placed(engines: int, by_hand: str | None = None,
           cpus: list[int] | None = None) -> tuple[list[int] | None, list[tuple[int, ...]] | None]:
    """The server's CPUs and each engine process's (`share`), or those `--engine-cpus` gives
    (the server then takes every usable CPU they leave, or all where they leave none)."""
    cpus = usable_cpus() if cpus is None else cpus
    if not by_hand:
        return share(cpus, engines)
    lists = parse_cpu_lists(by_hand)
    if len(lists) != engines:
        raise ValueError(f"--engine-cpus names {len(lists)} CPU lists for {engines} engine process(es)")
    unknown = sorted({c for cpus_ in lists for c in cpus_} - set(cpus))
    if unknown:
        raise ValueError(f"--engine-cpus: CPUs {unknown} are not this process's to use ({cpus})")
    taken = {c for cpus_ in lists for c in cpus_}
    return [c for c in cpus if c not in taken] or None, lists
