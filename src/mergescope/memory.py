"""Peak resident memory of this process, per stretch of work (Linux: ``VmHWM``, reset through ``clear_refs``)."""

from __future__ import annotations

import resource

GiB = 2**30


def reset_peak() -> None:
    """Start a new stretch: the kernel's high-water mark set back to the current resident set (Linux >= 4.0);
    elsewhere nothing happens and :func:`peak_gb` reports the process's peak so far."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def process_peak_gb() -> float:
    """The process's peak resident set since it started (GiB; ``ru_maxrss``, not moved by :func:`reset_peak`)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB


def peak_gb() -> float:
    """The process's peak resident set since the last :func:`reset_peak` (GiB)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / GiB
    except OSError:
        pass
    return process_peak_gb()
