"""Draw a goodput report (scripts/bench_goodput.py's JSON) as an SVG (harness.goodput_plot: steps
over time, kills and rejoins, losses over steps). bench_goodput.py writes it beside its JSON; by hand:

    python scripts/plot_goodput.py goodput.json goodput.svg
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from harness.goodput_plot import draw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", type=Path)
    parser.add_argument("svg", type=Path)
    args = parser.parse_args()
    args.svg.write_text(draw(json.loads(args.report.read_text())))


if __name__ == "__main__":
    main()
