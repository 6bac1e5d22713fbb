"""Draw a goodput report (scripts/bench_goodput.py's JSON) as an SVG: each approach's steps over
time since t0 (its ``timeline``: a pause is a flat stretch, a rollback a drop), the schedule's kills
and rejoins as vertical lines.

    python scripts/plot_goodput.py goodput.json goodput.svg
"""

from __future__ import annotations

import argparse
import json
from html import escape
from pathlib import Path

WIDTH, HEIGHT, MARGIN = 900, 420, 60
COLOURS = ["#222222", "#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2"]


def draw(report: dict) -> str:
    """The SVG document of ``report``."""
    duration = report["duration_s"]
    series = {name: [(t, step - r["started_from_step"]) for t, step, _ in r["timeline"]]
              for name, r in report["results"].items()}
    top = max((step for points in series.values() for _, step in points), default=1)

    def x(t: float) -> float:
        return MARGIN + (WIDTH - 2 * MARGIN) * t / duration

    def y(step: float) -> float:
        return HEIGHT - MARGIN - (HEIGHT - 2 * MARGIN) * step / top

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
             f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
             f'<line x1="{MARGIN}" y1="{y(0)}" x2="{x(duration)}" y2="{y(0)}" stroke="black"/>',
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
    parts.append("</svg>")
    return "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", type=Path)
    parser.add_argument("svg", type=Path)
    args = parser.parse_args()
    args.svg.write_text(draw(json.loads(args.report.read_text())))


if __name__ == "__main__":
    main()
