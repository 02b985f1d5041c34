"""`python -m poplar_bench.pipeline_search_gap`: where its results go by default."""

from __future__ import annotations

from pathlib import Path

from poplar_bench import pipeline_search_gap
from poplar_bench.commands._options import default_output_dir


def test_results_go_to_bench_results_by_default(monkeypatch, tmp_path, capsys):
    # docs/bench.md: it writes bench/results/pipeline_search_gap.{json,md} (the checkout's results folder).
    written = {}

    def write(report, markdown, output_dir, name):
        written["dir"] = Path(output_dir)
        return [Path(output_dir) / f"{name}.json"]

    monkeypatch.setattr(pipeline_search_gap, "gap_report", lambda cases: {"cases": cases})
    monkeypatch.setattr(pipeline_search_gap, "render", lambda report: "")
    monkeypatch.setattr(pipeline_search_gap, "write_json_and_markdown", write)
    pipeline_search_gap.main(["--cases", "1"])
    assert written["dir"] == default_output_dir()
    pipeline_search_gap.main(["--cases", "1", "--output-dir", str(tmp_path)])
    assert written["dir"] == tmp_path
