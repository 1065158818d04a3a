"""Run outputs: metrics.csv appended row by row, equal to writing it whole."""

import os

from pfljax.experiment.outputs import CsvLog, write_csv


def test_csv_log_appends_and_equals_the_whole_table(tmp_path):
    path, whole = str(tmp_path / "m.csv"), str(tmp_path / "whole.csv")
    rows = [{"round": 1, "acc": 0.5, "trace": [1, 2]}, {"round": 2, "acc": float("nan")}]
    log = CsvLog(path, rows[:1])
    size = os.path.getsize(path)
    log.append(rows[1])
    assert os.path.getsize(path) > size  # appended
    write_csv(whole, rows)
    assert open(path).read() == open(whole).read() == "round,acc\n1,0.5\n2,\n"
    # A new column rewrites the table once, header included.
    rows.append({"round": 3, "acc": 0.7, "dp_epsilon": 1.5})
    log.append(rows[-1])
    write_csv(whole, rows)
    assert open(path).read() == open(whole).read()
    assert open(path).readline().strip() == "round,acc,dp_epsilon"
