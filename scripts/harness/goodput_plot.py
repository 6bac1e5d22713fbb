"""A goodput report (scripts/bench_goodput.py's JSON) as an SVG: each approach's steps over time
since t0 (its ``timeline``: a pause is a flat stretch, a rollback a drop), the schedule's kills and
rejoins as vertical lines; below, where approaches logged their losses (the GPT workload), the loss
against the step of each, the fault-free run's included. SVG elements are written as text; no
plotting library."""

from __future__ import annotations

import math
from html import escape
from pathlib import Path

WIDTH, HEIGHT, MARGIN = 900, 420, 60
COLOURS = ["#222222", "#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2"]


def draw(report: dict) -> str:
    """The SVG document of ``report``: steps over time, then losses over steps where any were logged."""
    losses = {name: r["losses"] for name, r in report["results"].items() if r.get("losses")}
    panels = [_steps_panel(report)] + ([_losses_panel(losses)] if losses else [])
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT * len(panels)}" '
             f'font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/>']
    parts += [f'<g transform="translate(0 {HEIGHT * i})">{panel}</g>' for i, panel in enumerate(panels)]
    parts.append("</svg>")
    return "\n".join(parts)


def _steps_panel(report: dict) -> str:
    duration = report["duration_s"]
    series = {name: [(t, step - r["started_from_step"]) for t, step, _ in r["timeline"]]
              for name, r in report["results"].items()}
    top = max((step for points in series.values() for _, step in points), default=1)

    def x(t: float) -> float:
        return MARGIN + (WIDTH - 2 * MARGIN) * t / duration

    def y(step: float) -> float:
        return HEIGHT - MARGIN - (HEIGHT - 2 * MARGIN) * step / top

    parts = [f'<line x1="{MARGIN}" y1="{y(0)}" x2="{x(duration)}" y2="{y(0)}" stroke="black"/>',
             f'<line x1="{MARGIN}" y1="{y(0)}" x2="{MARGIN}" y2="{y(top)}" stroke="black"/>',
             f'<text x="{WIDTH / 2}" y="{HEIGHT - 15}" text-anchor="middle">seconds since the first step at the full '
             f'world size</text>',
             f'<text x="15" y="{HEIGHT / 2}" transform="rotate(-90 15 {HEIGHT / 2})" text-anchor="middle">steps '
             f'trained</text>',
             f'<text x="{MARGIN - 5}" y="{y(top) + 4}" text-anchor="end">{top}</text>',
             f'<text x="{x(duration)}" y="{y(0) + 15}" text-anchor="middle">{duration:.0f}</text>']
    for fault in report["schedule"]:
        dash = "4,3" if fault["action"] == "kill" else "1,3"
        parts.append(f'<line x1="{x(fault["at_s"]):.1f}" y1="{y(0)}" x2="{x(fault["at_s"]):.1f}" y2="{y(top)}" '
                     f'stroke="grey" stroke-dasharray="{dash}"/>')
        parts.append(f'<text x="{x(fault["at_s"]) + 3:.1f}" y="{y(0) - 4}" fill="grey">{fault["action"]} '
                     f'{fault["node"]}</text>')
    for i, (name, points) in enumerate(series.items()):
        colour = COLOURS[i % len(COLOURS)]
        path = " ".join(f"{x(t):.1f},{y(step):.1f}" for t, step in points)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        goodput = report["results"][name]["goodput"]
        parts.append(f'<text x="{MARGIN + 10}" y="{MARGIN + 16 * i}" fill="{colour}">{escape(name)} '
                     f'(goodput {goodput:.3f})</text>')
    return "\n".join(parts)


def _losses_panel(losses: dict[str, list[list[float]]]) -> str:
    """Each approach's loss against its step (the last value logged for a step that ran twice)."""
    series = {name: sorted({int(step): loss for step, loss in points if math.isfinite(loss)}.items())
              for name, points in losses.items()}
    steps = [step for points in series.values() for step, _ in points] or [0, 1]
    values = [loss for points in series.values() for _, loss in points] or [0.0, 1.0]
    first, last = min(steps), max(max(steps), min(steps) + 1)
    low, high = min(values), max(max(values), min(values) + 1e-9)

    def x(step: float) -> float:
        return MARGIN + (WIDTH - 2 * MARGIN) * (step - first) / (last - first)

    def y(loss: float) -> float:
        return HEIGHT - MARGIN - (HEIGHT - 2 * MARGIN) * (loss - low) / (high - low)

    parts = [f'<line x1="{MARGIN}" y1="{y(low)}" x2="{x(last)}" y2="{y(low)}" stroke="black"/>',
             f'<line x1="{MARGIN}" y1="{y(low)}" x2="{MARGIN}" y2="{y(high)}" stroke="black"/>',
             f'<text x="{WIDTH / 2}" y="{HEIGHT - 15}" text-anchor="middle">step</text>',
             f'<text x="15" y="{HEIGHT / 2}" transform="rotate(-90 15 {HEIGHT / 2})" text-anchor="middle">loss</text>',
             f'<text x="{MARGIN - 5}" y="{y(high) + 4}" text-anchor="end">{high:.3g}</text>',
             f'<text x="{MARGIN - 5}" y="{y(low) + 4}" text-anchor="end">{low:.3g}</text>',
             f'<text x="{x(first)}" y="{y(low) + 15}" text-anchor="middle">{first}</text>',
             f'<text x="{x(last)}" y="{y(low) + 15}" text-anchor="middle">{last}</text>']
    for i, (name, points) in enumerate(series.items()):
        colour = COLOURS[i % len(COLOURS)]
        path = " ".join(f"{x(step):.1f},{y(loss):.1f}" for step, loss in points)
        parts.append(f'<polyline class="loss" points="{path}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        parts.append(f'<text x="{WIDTH - MARGIN}" y="{MARGIN + 16 * i}" text-anchor="end" fill="{colour}">'
                     f'{escape(name)} loss</text>')
    return "\n".join(parts)


def write_beside(json_path: Path, report: dict) -> Path:
    """Draw ``report`` into the SVG beside its JSON (same name, .svg); its path."""
    picture = json_path.with_suffix(".svg")
    picture.write_text(draw(report))
    return picture
