"""The machine a benchmark runs on, as its JSON reports it.

Besides CPUs, memory, platform and load, it records whether the kernel hands freed memory back to
a hypervisor (virtio-balloon free page reporting), which moves figures between machines: on this
project's VMs, a page touched for the first time after its memory was reported costs 16-40 us
instead of 1.4 us (docs/measurements.md, "Fresh memory on these VMs"), so a process that
allocates fresh memory while it is timed (a restarted or joining worker's first step) is slower
here than on a machine whose memory stays backed.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path
from typing import Any

import psutil

PAGE_REPORTING_ORDER = Path("/sys/module/page_reporting/parameters/page_reporting_order")
"""Where Linux shows the smallest block (2**order pages) of free memory it reports to the host."""


def describe() -> dict[str, Any]:
    """The machine: CPUs, memory, platform, torch, how loaded it is now, and the order of the free
    memory blocks its kernel reports to a hypervisor (None: this kernel has no free page reporting)."""
    return {"cpus": os.cpu_count(), "memory_bytes": psutil.virtual_memory().total,
            "platform": platform.platform(), "torch": importlib.metadata.version("torch"),
            "load_avg_1m_5m_15m": [round(load, 2) for load in os.getloadavg()],
            "free_page_reporting_order": _page_reporting_order()}


def _page_reporting_order() -> int | None:
    try:
        return int(PAGE_REPORTING_ORDER.read_text())
    except (OSError, ValueError):
        return None
