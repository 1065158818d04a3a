"""experiments/bench/bench_weight_grad.py: the NN form equals XLA's product (checked inside measure)
and the rows say which shapes im2col_nn computes in that form."""

from experiments.bench import bench_weight_grad
from pfljax.models.conv import NN_WEIGHT_GRAD_MAX_COUT, NN_WEIGHT_GRAD_MIN_WIDTH


def test_measure_rows_on_either_side_of_the_thresholds():
    for k, n, nn_form in [
        (NN_WEIGHT_GRAD_MIN_WIDTH - 1, 8, False),
        (NN_WEIGHT_GRAD_MIN_WIDTH, 8, True),
        (NN_WEIGHT_GRAD_MIN_WIDTH, NN_WEIGHT_GRAD_MAX_COUT + 1, False),
    ]:
        row = bench_weight_grad.measure(64, k, n, repeats=1)
        assert row["shape"] == f"64x{k}x{n}"
        assert row["nn_in_im2col_nn"] == nn_form
        assert row["xla_gflops"] > 0 and row["nn_gflops"] > 0 and row["nn_over_xla"] > 0


def test_parse_shape():
    assert bench_weight_grad.parse_shape("6272x400x32") == (6272, 400, 32)
    assert bench_weight_grad.parse_shape("6272x400") is None
    assert bench_weight_grad.parse_shape("6272x0x32") is None
