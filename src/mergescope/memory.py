"""Peak resident memory of this process, per stretch of work (Linux: ``VmHWM``, reset through ``clear_refs``)."""

from __future__ import annotations

import resource

GiB = 2**30


_carried = 0.0  # the stretch's peak before its last job-level restart (start_job_peak), GiB


def _clear() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _hwm_gb() -> float | None:
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / GiB
    except OSError:
        pass
    return None


def reset_peak() -> None:
    """Start a new stretch: the kernel's high-water mark set back to the current resident set (Linux >= 4.0);
    elsewhere nothing happens and :func:`peak_gb` reports the process's peak so far."""
    global _carried
    _carried = 0.0
    _clear()


def start_job_peak() -> None:
    """Start one job's own peak (:func:`job_peak_gb`) inside the current stretch, whose peak (:func:`peak_gb`) still
    counts everything since its :func:`reset_peak`."""
    global _carried
    _carried = max(_carried, _hwm_gb() or 0.0)
    _clear()


def process_peak_gb() -> float:
    """The process's peak resident set since it started (GiB; ``ru_maxrss``, not moved by :func:`reset_peak`)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB


def job_peak_gb() -> float:
    """The peak resident set since the last :func:`start_job_peak` (or :func:`reset_peak`), GiB; the process's peak
    where the kernel cannot reset it (an upper bound)."""
    hwm = _hwm_gb()
    return hwm if hwm is not None else process_peak_gb()


def peak_gb() -> float:
    """The process's peak resident set since the last :func:`reset_peak` (GiB), its jobs' restarts included."""
    return max(_carried, job_peak_gb())
