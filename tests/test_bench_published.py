"""experiments/bench/bench_published.py: LEAF's per-client statistics drawn as documented, and a
one-round run of a shrunken variant printing every documented key."""

import json

import numpy as np
import pytest

from experiments.bench.bench_published import CASES, draw_counts, run_cases, scaled, synthetic_pool

KEYS = {
    "case", "rounds_timed", "s_per_round", "s_per_round_min_max", "projected_full_run_s", "published_s",
    "published_rounds", "clients", "clients_per_round", "samples_total", "backend", "device_kind",
    "load_average",
}  # fmt: skip


@pytest.mark.parametrize(
    "name, clients, mean, std",
    [("femnist_flute", 3400, 226.83, 88.94), ("shakespeare_flute", 715, 3743.2, 6212.26)],
)
def test_counts_have_leaf_mean_and_std_at_flute_clients(name, clients, mean, std):
    case = CASES[name]
    assert (case.clients, case.mean, case.std) == (clients, mean, std)
    counts = draw_counts(case.mean, case.std, case.clients, seed=0)
    assert counts.shape == (clients,) and counts.dtype == np.int32 and counts.min() >= 1
    np.testing.assert_allclose(counts.mean(), mean, rtol=1e-3)
    np.testing.assert_allclose(counts.std(), std, rtol=1e-3)
    np.testing.assert_array_equal(counts, draw_counts(case.mean, case.std, case.clients, seed=0))
    assert not np.array_equal(counts, draw_counts(case.mean, case.std, case.clients, seed=1))
    assert np.median(counts) < mean  # skewed as a log-normal


def test_pool_holds_each_clients_rows_with_the_largest_last():
    case = scaled(CASES["shakespeare_flute"], 0.01)
    counts = draw_counts(case.mean, case.std, case.clients, seed=0)
    pool = synthetic_pool(case, counts, seed=1)
    assert pool.x.dtype == np.uint8 and pool.x.shape == (counts.sum(), 80) and pool.x.max() < 80
    np.testing.assert_array_equal(pool.count, counts)
    assert pool.n_max == counts.max() and pool.offset[np.argmax(counts)] + pool.n_max == counts.sum()
    ends = np.sort(pool.offset + pool.count)
    np.testing.assert_array_equal(np.sort(pool.offset)[1:], ends[:-1])  # rows tile the pool


def test_one_round_of_a_shrunken_run_prints_every_key(capsys):
    run_cases(list(CASES), rounds=1, scale=0.005, seed=0, as_json=True)  # --json --rounds=1 --scale=0.005
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["case"] for r in rows] == ["femnist_flute", "shakespeare_flute"]
    for row, published in zip(rows, ((502, 1500), (1310, 1200))):
        assert KEYS <= set(row), KEYS - set(row)
        assert (row["published_s"], row["published_rounds"]) == published
        assert row["rounds_timed"] == 1 and row["s_per_round"] > 0 and row["backend"] == "cpu"
        assert row["projected_full_run_s"] == pytest.approx(row["s_per_round"] * published[1], rel=1e-3)
        assert row["clients_per_round"] == min(10, row["clients"])
    assert rows[0]["clients"] == 17 and rows[1]["clients"] == 4  # 3400 and 715 times 0.005
