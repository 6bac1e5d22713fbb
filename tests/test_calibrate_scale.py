"""calibrate_scale.py's rows from one run's measurements (the runs themselves take minutes and are
not repeated here): each row pairs the model's prediction from the run's parameters with the
figure measured in the same run."""

from __future__ import annotations

import pytest

import calibrate_scale  # scripts/ is on the path through conftest

BENCH = {"size_bytes": 10**9, "results": {
    "raw_read": {"cold_gbps": 2.0, "warm_gbps": 20.0},
    "torchrevive": {"cold_s": 0.6, "warm_s": 0.06},
    "torchsnapshot": {"cold_s": 2.2},
    "torch_load": {"cold_s": 1.3, "stream_cold_s": 1.0},
}}
CLUSTER = {"nproc_per_node": 1, "state_bytes": 5 * 10**8, "runs": [
    {"world_size_before": 4, "recovery_s": 9.0, "phases": {"first_step": 1.0}},
    {"world_size_before": 3, "recovery_s": 10.0, "phases": {"first_step": 1.5}},
]}


def test_rows_pair_predictions_with_figures_of_the_same_run():
    rows = calibrate_scale.restore_rows(BENCH, first_touch=2.0, overwrite=10.0, efficiency=0.25)
    start = {"warm_fork_s": 0.1, "process_group_init_s": 0.4, "model_build_s": 0.5}
    rows += calibrate_scale.recovery_rows(CLUSTER, BENCH, start, detect_s=0.2, fresh_touch_gbps=2.0)
    assert [what for what, _, _ in rows] == [
        "restore 1.0 GB, torchrevive, cold", "restore 1.0 GB, torchrevive, warm",
        "restore 1.0 GB, torchsnapshot, cold", "restore 1.0 GB, classic torch.load, cold",
        "recovery after a kill, 4 nodes x 1, 500 MB", "recovery after a freeze, 3 nodes x 1, 500 MB"]
    assert rows[0][1:] == (0.5, 0.6)  # 1 GB at the raw read, cold
    assert rows[1][1:] == (pytest.approx(0.05 + 0.1), 0.06)  # warm: the raw read, and landing in the tensors
    assert rows[2][1:] == (2.0, 2.2)  # at a quarter of the raw read
    assert rows[3][1] == 1.0 + 0.5 + 0.05  # the stream read beside it, first touch, then a warm copy
    assert [measured for _, _, measured in rows[4:]] == [8.0, 8.5]  # the first step left out
    # A kill is seen from the liveness connection, a freeze only once the heartbeats lapse (3 s);
    # both rounds start workers forked warm (1 s here).
    assert rows[5][1] > 3.0 + 1.0 > rows[4][1] > 0.2 + 1.0
    # The harness's job is DDP: each survivor copies the whole 500 MB from the page cache into
    # new pages, at 1 / (1/20 + 1/2) GB/s; detect 0.2 s, the round 3 polls of 0.1 s + 0.5 s.
    assert rows[4][1] == pytest.approx(0.2 + 0.8 + 1.0 + 0.5 * (1 / 20 + 1 / 2))
