"""The sine toy generator of FedeRiCo's Fig. 1."""

import math

import numpy as np
import pytest

from pfljax.data import load_source, sources
from pfljax.data.sine import make_sine_clients, sine_federated_data


def test_clients_hold_their_intervals_of_one_sine():
    xs, ys, truth = make_sine_clients(6, 40, num_intervals=3, noise=0.0, seed=1)
    np.testing.assert_array_equal(truth["interval"], [0, 0, 1, 1, 2, 2])
    np.testing.assert_allclose(truth["bounds"][:, 0], [-math.pi, -math.pi / 3, math.pi / 3], rtol=1e-12)
    for c, (x, y) in enumerate(zip(xs, ys)):
        assert x.shape == (40, 1) and y.shape == (40, 1) and x.dtype == np.float32
        lo, hi = truth["bounds"][truth["interval"][c]]
        assert np.all((x >= lo - 1e-6) & (x <= hi + 1e-6))
        np.testing.assert_allclose(y, np.sin(x), atol=1e-6)
    assert not np.allclose(xs[0], xs[1])  # same interval, own samples


def test_noise_seed_and_one_interval_per_client():
    a = make_sine_clients(4, 500, noise=0.3, seed=0, amplitude=2.0, frequency=0.5)
    b = make_sine_clients(4, 500, noise=0.3, seed=0, amplitude=2.0, frequency=0.5)
    c = make_sine_clients(4, 500, noise=0.3, seed=1, amplitude=2.0, frequency=0.5)
    np.testing.assert_array_equal(a[0][2], b[0][2])
    assert not np.allclose(a[0][2], c[0][2])
    np.testing.assert_array_equal(a[2]["interval"], np.arange(4))
    resid = np.concatenate([y - 2.0 * np.sin(0.5 * x) for x, y in zip(a[0], a[1])])
    assert abs(np.std(resid) - 0.3) < 0.02 and abs(np.mean(resid)) < 0.03


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_clients=0), "num_clients"),
        (dict(samples_per_client=0), "samples_per_client"),
        (dict(num_intervals=5), "num_intervals"),
        (dict(x_low=1.0, x_high=0.0), "x_high"),
        (dict(noise=-1.0), "noise"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = {"num_clients": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        make_sine_clients(**args)


def test_registered_source_and_federated_arrays():
    assert "sine" in sources.allowed_datasets()
    src = load_source("sine", num_clients=3, samples_per_client=10, seed=2)
    assert len(src.xs) == 3 and src.num_classes == 1 and src.ys[0].dtype == np.float32
    fd = sine_federated_data(8, samples_per_client=50, num_intervals=4, seed=2)
    assert fd.task == "regression" and fd.input_shape == (1,) and fd.num_classes == 1
    train, test = fd.data.train.padded(), fd.data.test.padded()
    assert train.x.shape == (8, 40, 1) and test.y.shape == (8, 10, 1)
    np.testing.assert_array_equal(fd.data.train.count, 40)
    assert [c["group"] for c in fd.summary["clients"]] == [0, 0, 1, 1, 2, 2, 3, 3]
    xs, ys, _ = make_sine_clients(8, 50, num_intervals=4, seed=2)
    # train and test rows of a client are a split of its own samples
    both = np.sort(np.concatenate([train.x[5, :, 0], test.x[5, :, 0]]))
    np.testing.assert_array_equal(both, np.sort(xs[5][:, 0]))
