"""hftrain.jsonl: what a resumed run keeps of its JSON-lines files (metrics, completions, rollouts)."""

import json

from hftrain.jsonl import keep_through


def write(path, rows, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail, encoding="utf-8")


def test_rows_after_the_resumed_step_and_a_cut_line_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}, {"step": 3, "loss": 1.2}, {"step": 2, "eval": 1.4}]
    write(path, rows, tail='{"step": 4, "lo')  # a crash mid-write
    keep_through(path, 2)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [rows[0], rows[1], rows[3]]


def test_another_key_and_an_absent_file(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    write(path, [{"window": 0}, {"window": 1}, {"window": 2}, {"step": 9}])
    keep_through(path, 1, key="window")
    assert path.read_text().splitlines() == ['{"window": 0}', '{"window": 1}']
    keep_through(tmp_path / "absent.jsonl", 3)
    assert not (tmp_path / "absent.jsonl").exists()
