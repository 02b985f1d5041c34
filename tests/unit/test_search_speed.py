"""bench/search_speed.py: the report's shape (timings themselves are not asserted)."""

import json

from bench.search_speed import run_search_speed, write_report


def test_report_has_every_cell_and_goal_and_is_written(tmp_path):
    report = run_search_speed(rank_counts=(8, 64), type_counts=(1, 2), repeats=1)
    assert [(c["ranks"], c["device_types"]) for c in report["cells"]] == [(8, 1), (8, 2), (64, 1), (64, 2)]
    cell = report["cells"][0]
    assert cell["fixed_batch"]["global_batch_size"] == 32 * 8 + 7
    assert len(cell["auto_batch"]["repetitions_s"]) == 1
    assert [g["goal"] for g in report["goals"]] == ["64 ranks (1 to 6 device types) under 0.05 s"]
    assert report["machine"]["libraries"]["numpy"]
    paths = write_report(report, tmp_path)
    assert json.loads(paths[0].read_text())["cells"] == report["cells"]
    assert "| 64 | 2 |" in paths[1].read_text()
