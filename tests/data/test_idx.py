"""Tests for the IDX reader and the Fashion-MNIST loader."""

import gzip
import os

import numpy as np
import pytest

from pfljax.data import idx

HAVE_FMNIST = all(
    os.path.isfile(os.path.join(idx.DEFAULT_FASHION_MNIST_DIR, s + ".gz"))
    for s in idx.FASHION_MNIST_FILES.values()
)

_CODES = {np.uint8: 0x08, np.int16: 0x0B, np.int32: 0x0C, np.float32: 0x0D}


def write_idx(path, array, compress):
    array = np.asarray(array)
    header = bytes([0, 0, _CODES[array.dtype.type], array.ndim])
    header += np.asarray(array.shape, ">i4").tobytes()
    payload = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    with open(path, "wb") as f:
        f.write(gzip.compress(payload) if compress else payload)


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.int32, np.float32])
def test_read_idx_roundtrip(tmp_path, compress, dtype):
    array = (np.arange(24).reshape(2, 3, 4) * 7 - 20).astype(dtype)
    if dtype == np.uint8:
        array = np.arange(24, dtype=np.uint8).reshape(2, 3, 4) * 10
    path = tmp_path / ("a.idx.gz" if compress else "a.idx")
    write_idx(path, array, compress)
    out = idx.read_idx(str(path))
    assert out.dtype == np.dtype(dtype) and out.shape == (2, 3, 4)
    np.testing.assert_array_equal(out, array)


def test_read_idx_rejects_bad_files(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x01\x02\x03\x04rubbish")
    with pytest.raises(ValueError, match="not an IDX file"):
        idx.read_idx(str(bad))
    short = tmp_path / "short"
    write_idx(short, np.zeros((4, 2), np.uint8), compress=False)
    short.write_bytes(short.read_bytes()[:-3])
    with pytest.raises(ValueError, match="payload"):
        idx.read_idx(str(short))


def make_tiny_fmnist(directory, compress=True):
    """Writes 5 train / 3 test 28x28 images with known pixels and labels."""
    rng = np.random.default_rng(0)
    arrays = {
        "train_images": rng.integers(0, 256, (5, 28, 28), dtype=np.uint8),
        "train_labels": np.array([0, 1, 2, 9, 9], np.uint8),
        "test_images": rng.integers(0, 256, (3, 28, 28), dtype=np.uint8),
        "test_labels": np.array([3, 4, 5], np.uint8),
    }
    for key, stem in idx.FASHION_MNIST_FILES.items():
        name = stem + (".gz" if compress else "")
        write_idx(os.path.join(directory, name), arrays[key], compress)
    return arrays


@pytest.mark.parametrize("compress", [True, False])
def test_load_fashion_mnist_from_any_directory(tmp_path, compress):
    arrays = make_tiny_fmnist(tmp_path, compress)
    d = idx.load_fashion_mnist(str(tmp_path))
    assert d["x_train"].shape == (5, 28, 28, 1)
    assert d["x_train"].dtype == np.float32 and d["y_train"].dtype == np.int32
    np.testing.assert_allclose(d["x_train"][..., 0], arrays["train_images"] / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(d["y_test"], [3, 4, 5])
    assert 0.0 <= d["x_test"].min() and d["x_test"].max() <= 1.0
    s = idx.load_fashion_mnist(str(tmp_path), standardize=True)
    assert abs(s["x_train"].mean()) < 1e-5
    assert abs(s["x_train"].std() - 1.0) < 1e-4
    # The test split is standardized with the train statistics.
    mean, std = d["x_train"].mean(), d["x_train"].std()
    np.testing.assert_allclose(s["x_test"], (d["x_test"] - mean) / std, rtol=1e-5, atol=1e-5)


def test_symmetric_pixel_scale_maps_codes_to_minus_one_one(tmp_path):
    """pixel_scale="symmetric": (x / 255 - 0.5) / 0.5 (PFLlib's ToTensor + Normalize(0.5,
    0.5); tests/data/test_pfllib_exact.py checks it bit for bit against torchvision's)."""
    arrays = make_tiny_fmnist(tmp_path)
    d = idx.load_fashion_mnist(str(tmp_path), pixel_scale="symmetric")
    np.testing.assert_allclose(d["x_train"][..., 0], arrays["train_images"] / 127.5 - 1.0, atol=1e-6)
    c = idx.load_fashion_mnist(str(tmp_path), pixel_scale="symmetric", codes=True)
    assert c["x_test"].dtype == np.uint8 and c["levels"][[0, 255]].tolist() == [-1.0, 1.0]
    np.testing.assert_array_equal(c["levels"][c["x_test"]], d["x_test"])
    with pytest.raises(ValueError, match="pixel_scale='half' is unknown"):
        idx.load_fashion_mnist(str(tmp_path), pixel_scale="half")
    with pytest.raises(ValueError, match="pixel_scale='symmetric' with standardize=True"):
        idx.load_fashion_mnist(str(tmp_path), pixel_scale="symmetric", standardize=True)


def test_missing_directory_or_files_raise_naming_data_dir(tmp_path):
    with pytest.raises(ValueError, match="data_dir.*not a directory"):
        idx.load_fashion_mnist(str(tmp_path / "nope"))
    make_tiny_fmnist(tmp_path)
    os.remove(tmp_path / "t10k-labels-idx1-ubyte.gz")
    with pytest.raises(ValueError, match="data_dir.*t10k-labels-idx1-ubyte"):
        idx.load_fashion_mnist(str(tmp_path))


@pytest.mark.skipif(
    not HAVE_FMNIST,
    reason="Fashion-MNIST IDX files absent "
    "from /usr/share/datasets/fashion-mnist (Debian package "
    "dataset-fashion-mnist)",
)
def test_real_fashion_mnist_from_default_directory():
    d = idx.load_fashion_mnist()
    assert d["x_train"].shape == (60000, 28, 28, 1)
    assert d["x_test"].shape == (10000, 28, 28, 1)
    np.testing.assert_array_equal(np.bincount(d["y_train"]), [6000] * 10)
    np.testing.assert_array_equal(np.bincount(d["y_test"]), [1000] * 10)
    assert d["x_train"].min() == 0.0 and d["x_train"].max() == 1.0
    # Fashion-MNIST's known mean pixel is 0.2860.
    assert abs(d["x_train"].mean() - 0.2860) < 1e-3
