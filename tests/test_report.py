"""`torchrevive report` on a real event log: the compiled GPT's in-process goodput run of
2026-12-05 on the commit before the DTensor mesh fix (4 nodes, a kill at 100 s and 200 s, rejoins
30 s later; its snapshots after the first join could not be restored, and the job fell back to the
restart path)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest
from conftest import REPO

from agent.events import read_events
from agent.report import job_report, render
from agent.report_plot import ROW_SPAN, draw_timeline

LOG = Path(__file__).parent / "data" / "events_gpt_in_process_mesh_defect.jsonl"


def test_the_report_tells_rounds_recoveries_saves_and_problems():
    report = job_report(read_events(LOG))
    assert [(r["round"], r["world_size"], r["restore_from"]) for r in report["rounds"]] == [
        (0, 4, None), (1, 3, "step_25"), (2, 4, "step_35"), (3, 3, "step_45"), (4, 3, "step_45"),
        (5, 4, "step_45"), (6, 4, "step_45")]
    assert report["rounds"][1]["lost"] == ["localhost_22044_0"] and report["rounds"][2]["joined"] == ["localhost_22285_0"]
    recoveries = report["recoveries"]
    # The kill at 100 s and the join, in-process; after the second kill, workers failed (they could not
    # restore the newest snapshots, and saving a step committed already crashed them): the restart path.
    assert [(r["cause"], r.get("path"), r.get("restored_step")) for r in recoveries] == [
        ("node_lost", "in_process", 25), ("node_joined", "in_process", 35), ("worker_failed", "in_process", 35),
        ("worker_failed", "restart", 35), ("worker_failed", "restart", 35), ("worker_failed", "restart", 35),
        ("node_lost", None, None)]
    assert not recoveries[-1]["completed"]  # the benchmark killed every node at its end
    first = recoveries[0]
    assert first["recovery_s"] == pytest.approx(sum(first["phases"].values()))
    assert report["saves"]["committed"] == 9 and report["saves"]["steps"] == [5, 45]
    problems = {p["event"]: p for p in report["problems"]}
    assert problems["restore_fallback"]["count"] == 28
    assert "step_45" in problems["restore_fallback"]["first"] and "metadata is damaged" in problems["restore_fallback"]["first"]
    assert problems["in_process_fallback"]["first"] == "reason: a worker process ended"


def test_the_command_prints_the_report_or_its_json(tmp_path):
    text = subprocess.run([sys.executable, "-m", "launcher.cli", "report", str(LOG)], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout
    assert text == render(job_report(read_events(LOG)))
    assert "  119.0 s  node_lost: 4 -> 3 ranks in 4.72 s (in_process): detect 0.02 rendezvous 0.50" in text
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "report", "--json", str(LOG)], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == json.loads(json.dumps(job_report(read_events(LOG))))
    empty = tmp_path / "events.jsonl"
    empty.write_text("")
    failed = subprocess.run([sys.executable, "-m", "launcher.cli", "report", str(empty)], cwd=REPO, capture_output=True,
                            text=True)
    assert failed.returncode == 1 and failed.stderr == f"torchrevive report: error: {empty}: the event log holds no event\n"
    missing = subprocess.run([sys.executable, "-m", "launcher.cli", "report", str(tmp_path / "none.jsonl")], cwd=REPO,
                             capture_output=True, text=True)
    assert missing.returncode == 1 and "none.jsonl" in missing.stderr


def test_the_plot_draws_each_round_failure_recovery_and_save(tmp_path):
    svg = tmp_path / "timeline.svg"
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "report", str(LOG), "--plot", str(svg)], cwd=REPO,
                          capture_output=True, text=True, check=True)
    report = job_report(read_events(LOG))
    assert done.stdout == render(report)  # the text report still comes, the picture beside it
    root = ElementTree.parse(svg).getroot()  # well-formed XML, self-contained SVG
    assert root.tag == "{http://www.w3.org/2000/svg}svg"

    def drawn(kind: str) -> list[ElementTree.Element]:
        return [e for e in root.iter() if e.get("class") == kind]

    assert [e.get("data-round") for e in drawn("round")] == [str(r["round"]) for r in report["rounds"]]
    assert len(drawn("failure")) == len(report["recoveries"]) == 7
    assert [e.get("data-tier") for e in drawn("save")] == ["storage"] * report["saves"]["committed"]
    assert len(drawn("save")) == 9  # this job's memory tier was off
    events = read_events(LOG)
    memory_save = {**next(e for e in events if e["event"] == "save_committed"), "event": "memory_save_committed"}
    with_memory = ElementTree.fromstring(draw_timeline([*events, memory_save]))
    assert [e.get("data-tier") for e in with_memory.iter() if e.get("class") == "save"].count("memory") == 1
    # Each recovery twice: on the job's timeline, and alone to a scale of its own.
    causes = [r["cause"] for r in report["recoveries"]]
    assert [g.get("data-cause") for g in drawn("recovery")] == causes * 2
    first = drawn("recovery")[len(causes)]
    phases = [p for p in first.iter() if p.get("class") == "phase"]
    assert [p.get("data-phase") for p in phases] == list(report["recoveries"][0]["phases"])
    assert "node_lost: 4 -> 3 ranks in 4.72 s (in_process)" in first.find("{http://www.w3.org/2000/svg}title").text
    widths = [float(p.get("width")) for p in phases]
    longest = max(r["recovery_s"] for r in report["recoveries"] if r["completed"])
    assert sum(widths) == pytest.approx(ROW_SPAN * report["recoveries"][0]["recovery_s"] / longest, abs=3)
    unfinished = drawn("recovery")[-1]
    assert not [p for p in unfinished.iter() if p.get("class") == "phase"]  # not completed: no phases to draw

    failed = subprocess.run([sys.executable, "-m", "launcher.cli", "report", str(LOG), "--plot",
                             str(tmp_path / "none" / "t.svg")], cwd=REPO, capture_output=True, text=True)
    assert failed.returncode == 1 and failed.stderr.startswith("torchrevive report: error: ")
    assert "none/t.svg" in failed.stderr
