"""`torchrevive report EVENT_LOG --plot out.svg`: the job's timeline as a self-contained SVG, drawn
as scripts/plot_goodput.py draws (SVG elements written as text; no plotting library).

Top, over the job's seconds: its rounds (one band each, with the world size), each failure (a
dashed line where the recovery began), each recovery as a bar of its phases, and each committed
save (a tick; a shorter one for the memory tier). Below: each recovery alone, its phases to a
scale of their own (a recovery lasts seconds; a job, hours). Every element carries a ``class`` (``round``, ``failure``, ``recovery``,
``phase``, ``save``) and a ``<title>`` that a browser shows on hover.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from html import escape
from typing import Any

from agent.recovery_timeline import Event
from agent.report import job_report, recovery_line, round_line

WIDTH, MARGIN, LANE, TOP = 1000, 90, 28, 40
SPAN = WIDTH - 2 * MARGIN
"""The width of the time axis, in pixels."""
ROW_SPAN = SPAN - 150
"""The width of the longest recovery on its row (its label follows)."""
PHASE_COLOURS = {"detect": "#d62728", "rendezvous": "#ff7f0e", "workers_start": "#9467bd", "restore": "#1f77b4",
                 "first_step": "#2ca02c"}
ROUND_FILLS = ("#e8eef7", "#d4e0f0")
SAVE_EVENTS = {"save_committed": "storage", "memory_save_committed": "memory"}
"""The events of a committed save, and the tier each tells of."""
SAVE_COLOURS = {"storage": "#2ca02c", "memory": "#17becf"}
TICK_STEPS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400)


def draw_timeline(events: Sequence[Event]) -> str:
    """The SVG document of the job the events tell; ValueError when there is no event."""
    report = job_report(events)
    recoveries = report["recoveries"]
    saves = sorted({(SAVE_EVENTS[e["event"]], e["step"]): e["time"] - report["start"]
                    for e in events if e["event"] in SAVE_EVENTS}.items())
    rows_y = TOP + 3 * (LANE + 8) + 60
    legend_y = rows_y + LANE * max(1, len(recoveries)) + 25
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{legend_y + 25}" '
             'font-family="sans-serif" font-size="11"><rect width="100%" height="100%" fill="white"/>',
             f'<text x="{MARGIN}" y="20" font-size="13">{len(report["rounds"])} rounds, '
             f'{sum(r["completed"] for r in recoveries)} recoveries, {report["saves"]["committed"]} saves, '
             f'{report["saves"]["memory_committed"]} memory saves in {report["seconds"]:.0f} s</text>',
             *_job_lanes(report, saves), *_recovery_rows(recoveries, rows_y)]
    for i, (phase, colour) in enumerate(PHASE_COLOURS.items()):
        parts.append(f'<rect x="{MARGIN + 120 * i}" y="{legend_y - 10}" width="12" height="12" fill="{colour}"/>'
                     f'<text x="{MARGIN + 120 * i + 16}" y="{legend_y}">{phase}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _job_lanes(report: dict[str, Any], saves: list[tuple[tuple[str, int], float]]) -> list[str]:
    """The rounds, recoveries and saves lanes over the job's seconds, failures across them."""
    seconds = max(report["seconds"], 1e-9)

    def x(t: float) -> float:
        return MARGIN + SPAN * min(max(t, 0.0), seconds) / seconds

    rounds_y, recoveries_y, saves_y = TOP, TOP + LANE + 8, TOP + 2 * (LANE + 8)
    bottom = saves_y + LANE
    parts = [f'<text x="{MARGIN - 8}" y="{y + LANE / 2 + 4}" text-anchor="end">{label}</text>'
             for label, y in (("rounds", rounds_y), ("recoveries", recoveries_y), ("saves", saves_y))]
    parts.append(_axis(x, seconds, bottom + 4))
    ends = [r["at_s"] for r in report["rounds"][1:]] + [seconds]
    for i, (r, end) in enumerate(zip(report["rounds"], ends)):
        left, right = x(r["at_s"]), x(end)
        parts.append(f'<rect class="round" data-round="{escape(str(r["round"]))}" x="{left:.1f}" y="{rounds_y}" '
                     f'width="{max(right - left, 1):.1f}" height="{LANE}" fill="{ROUND_FILLS[i % 2]}" '
                     f'stroke="white"><title>{escape(round_line(r).strip())}</title></rect>')
        if right - left > 40:
            ranks = " ranks" if right - left > 75 else ""
            parts.append(f'<text x="{left + 3:.1f}" y="{rounds_y + LANE / 2 + 4}">r{escape(str(r["round"]))}: '
                         f'{escape(str(r["world_size"]))}{ranks}</text>')
    for r in report["recoveries"]:
        left = x(r["at_s"])
        parts.append(f'<line class="failure" x1="{left:.1f}" y1="{rounds_y}" x2="{left:.1f}" y2="{bottom}" '
                     f'stroke="#d62728" stroke-dasharray="4,3"><title>{escape(str(r["cause"]))} at '
                     f'{r["at_s"]:.1f} s</title></line>')
        parts.append(_recovery_bar(r, left, recoveries_y, lambda s, at=r["at_s"], left=left: x(at + s) - left))
    for (tier, step), at in saves:
        low = saves_y + (LANE - 4 if tier == "storage" else LANE / 2)  # a memory save: a shorter tick
        parts.append(f'<line class="save" data-tier="{tier}" x1="{x(at):.1f}" y1="{saves_y + 4}" x2="{x(at):.1f}" '
                     f'y2="{low}" stroke="{SAVE_COLOURS[tier]}" stroke-width="2"><title>step {escape(str(step))} committed '
                     f'({tier}) at {at:.1f} s</title></line>')
    return parts


def _recovery_rows(recoveries: list[dict[str, Any]], top: float) -> list[str]:
    """Each recovery on a row of its own from ``top``, its phases to the scale of the longest."""
    longest = max((r["recovery_s"] for r in recoveries if r["completed"]), default=1.0) or 1.0
    parts = [f'<text x="{MARGIN}" y="{top - 12}" font-size="13">each recovery by phase (failure to every '
             f'rank\'s first step), to a scale of {longest:.1f} s</text>']
    for i, r in enumerate(recoveries):
        y = top + i * LANE
        parts.append(f'<text x="{MARGIN - 8}" y="{y + LANE / 2 + 4}" text-anchor="end">{r["at_s"]:.0f} s</text>')
        parts.append(_recovery_bar(r, MARGIN, y, lambda s: ROW_SPAN * s / longest, label=True))
    return parts


def _recovery_bar(r: dict[str, Any], left: float, y: float, width: Callable[[float], float], *,
                  label: bool = False) -> str:
    """One recovery as a ``<g class="recovery">`` of its phases side by side from ``left``
    (``width(seconds)``: their length in pixels); an incomplete one as a grey mark."""
    cause = escape(str(r["cause"]))
    parts = [f'<g class="recovery" data-cause="{cause}"><title>{escape(recovery_line(r).strip())}</title>']
    text_y = y + LANE / 2 + 4
    if not r["completed"]:
        parts.append(f'<rect x="{left:.1f}" y="{y + 4}" width="8" height="{LANE - 8}" fill="#999999"/>')
        if label:
            parts.append(f'<text x="{left + 12:.1f}" y="{text_y}">{cause}: not completed</text>')
        return "".join(parts) + "</g>"
    at = 0.0
    for phase, seconds in r["phases"].items():
        start, end = left + width(at), left + width(at + seconds)
        parts.append(f'<rect class="phase" data-phase="{phase}" x="{start:.2f}" y="{y + 4}" '
                     f'width="{max(end - start, 0.5):.2f}" height="{LANE - 8}" '
                     f'fill="{PHASE_COLOURS.get(phase, "#777777")}"><title>{phase} {seconds:.2f} s</title></rect>')
        at += seconds
    if label:
        parts.append(f'<text x="{left + width(at) + 6:.1f}" y="{text_y}">{cause} {r["recovery_s"]:.2f} s '
                     f'({r["path"]})</text>')
    return "".join(parts) + "</g>"


def _axis(x: Callable[[float], float], seconds: float, y: float) -> str:
    """The time axis at ``y``: a tick every round number of seconds, about ten in all."""
    step = next((s for s in TICK_STEPS if seconds / s <= 10), TICK_STEPS[-1] * math.ceil(seconds / TICK_STEPS[-1] / 10))
    ticks = [f'<line x1="{x(0):.1f}" y1="{y}" x2="{x(seconds):.1f}" y2="{y}" stroke="black"/>']
    for t in range(0, int(seconds) + 1, step):
        ticks.append(f'<line x1="{x(t):.1f}" y1="{y}" x2="{x(t):.1f}" y2="{y + 4}" stroke="black"/>'
                     f'<text x="{x(t):.1f}" y="{y + 16}" text-anchor="middle">{t}</text>')
    ticks.append(f'<text x="{WIDTH / 2}" y="{y + 32}" text-anchor="middle">seconds since the log\'s first '
                 'event</text>')
    return "".join(ticks)

