"""Tests for the TFDS source: offline preparation and loading."""

import os
import subprocess
import sys

import numpy as np
import pytest

from pfljax.data import idx, load_source
from pfljax.data.sources import Pooled

FMNIST_DIR = idx.DEFAULT_FASHION_MNIST_DIR
HAVE_FMNIST = all(
    os.path.isfile(os.path.join(FMNIST_DIR, s + ".gz")) for s in idx.FASHION_MNIST_FILES.values()
)


def test_importing_pfljax_data_does_not_import_tensorflow():
    code = (
        "import sys, pfljax.data, pfljax.data.tfds_source; "
        "bad = [m for m in ('tensorflow', 'tensorflow_datasets') "
        "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_unknown_tfds_name_raises_naming_dataset(tmp_path):
    with pytest.raises(ValueError, match="dataset='tfds:no_such_set_xyz'"):
        load_source("tfds:no_such_set_xyz", data_dir=str(tmp_path))


def _stub_tfds(monkeypatch, error):
    """tensorflow_datasets replaced by a stub whose builder raises `error` (no network,
    no TensorFlow import); it knows 444 data sets."""
    import types  # noqa: PLC0415

    names = ["fashion_mnist", "mnist", "kmnist", *[f"set_{i}" for i in range(441)]]

    def builder(name, data_dir=None):
        raise error

    stub = types.SimpleNamespace(builder=builder, list_builders=lambda: names)
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", stub)


def test_unknown_tfds_name_is_one_short_line_with_close_names_and_a_count(monkeypatch, tmp_path):
    not_found = type("DatasetNotFoundError", (ValueError,), {})
    listing = "Dataset fashion_mnistt not found.\nAvailable datasets:\n" + "\t- some_set\n" * 450
    _stub_tfds(monkeypatch, not_found(listing))
    with pytest.raises(ValueError) as info:
        load_source("tfds:fashion_mnistt", data_dir=str(tmp_path))
    assert str(info.value) == (
        "dataset='tfds:fashion_mnistt' is not a TFDS data set known to tensorflow_datasets "
        "(did you mean 'fashion_mnist'? 444 known: tfds.list_builders())"
    )
    _stub_tfds(monkeypatch, not_found(listing))
    with pytest.raises(
        ValueError, match=r"^dataset='tfds:zzzz' is not .* \(444 known: tfds.list_builders\(\)\)$"
    ):
        load_source("tfds:zzzz", data_dir=str(tmp_path))


def test_other_tfds_builder_errors_keep_their_first_line_only(monkeypatch, tmp_path):
    _stub_tfds(monkeypatch, ValueError("BuilderConfig nosuchcfg not found.\n" + "\t- cfg\n" * 200))
    with pytest.raises(ValueError) as info:
        load_source("tfds:mnist/nosuchcfg", data_dir=str(tmp_path))
    assert str(info.value) == (
        "dataset='tfds:mnist/nosuchcfg': tensorflow_datasets cannot build it: "
        "BuilderConfig nosuchcfg not found."
    )


def sorted_examples(x, y):
    """Rows (label, pixels as uint8) sorted, to compare data sets as sets."""
    pixels = np.round(x.reshape(len(x), -1) * 255).astype(np.uint8)
    rows = np.concatenate([y[:, None].astype(np.uint8), pixels], axis=1)
    return rows[np.lexsort(rows.T[::-1])]


@pytest.mark.skipif(
    not HAVE_FMNIST,
    reason="Fashion-MNIST IDX files absent "
    "from /usr/share/datasets/fashion-mnist (Debian package "
    "dataset-fashion-mnist)",
)
def test_tfds_fashion_mnist_prepared_offline_matches_idx(tmp_path):
    data_dir = str(tmp_path / "tfds")
    # Not prepared yet: a clear error naming data_dir.
    with pytest.raises(ValueError, match="data_dir"):
        load_source("tfds:fashion_mnist", data_dir=data_dir)
    # Prepare from the local IDX files (no network) and load.
    src = load_source("tfds:fashion_mnist", data_dir=data_dir, prepare_from=FMNIST_DIR)
    assert isinstance(src, Pooled) and src.num_classes == 10
    assert src.x_train.shape == (60000, 28, 28, 1)
    assert src.x_train.dtype == np.uint8 and src.y_train.dtype == np.int32  # pixels stay uint8
    values = src.values(src.x_train)
    assert values.dtype == np.float32 and 0.0 <= values.min() and values.max() <= 1.0
    ref = idx.load_fashion_mnist(FMNIST_DIR)
    for split in ("train", "test"):
        tf_x, tf_y = src.values(getattr(src, f"x_{split}")), getattr(src, f"y_{split}")
        np.testing.assert_array_equal(
            sorted_examples(tf_x, tf_y), sorted_examples(ref[f"x_{split}"], ref[f"y_{split}"])
        )
    # TFDS shuffles examples when writing: same set, different order.
    assert not np.array_equal(src.y_train, ref["y_train"])
    # A second load reads the prepared copy (nothing is re-prepared).
    again = load_source("tfds:fashion_mnist", data_dir=data_dir, splits=("test",))
    assert again.x_train.shape == (10000, 28, 28, 1)
    np.testing.assert_array_equal(again.y_train, src.y_test)


@pytest.mark.parametrize("standardize", [False, True])
def test_pixel_values_codes_and_floats_agree(standardize):
    """load_tfds's pixel step without TFDS: levels[codes] equal the float images, bit for bit."""
    from pfljax.data.tfds_source import _pixel_values

    rng = np.random.default_rng(0)
    raw = {
        "x_train": rng.integers(0, 256, (6, 2, 2, 1), np.uint8),
        "x_test": rng.integers(0, 256, (3, 2, 2, 1), np.uint8),
    }
    codes, floats, wide = dict(raw), dict(raw), {k: v.astype(np.int32) for k, v in raw.items()}
    levels = _pixel_values(codes, ("train", "test"), standardize=standardize, codes=True)
    assert _pixel_values(floats, ("train", "test"), standardize=standardize, codes=False) is None
    assert _pixel_values(wide, ("train", "test"), standardize=standardize, codes=True) is None  # not uint8
    assert codes["x_train"] is raw["x_train"] and levels.dtype == np.float32 and levels.shape == (256,)
    first = raw["x_train"].astype(np.float32) / 255.0
    for s in ("train", "test"):
        want = raw[f"x_{s}"].astype(np.float32) / 255.0
        if standardize:
            want = (want - first.mean()) / first.std()
        np.testing.assert_allclose(floats[f"x_{s}"], want, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(levels[codes[f"x_{s}"]], floats[f"x_{s}"])
        assert floats[f"x_{s}"].dtype == wide[f"x_{s}"].dtype == np.float32
        np.testing.assert_allclose(
            wide[f"x_{s}"], want * (1.0 if standardize else 255.0), rtol=1e-5, atol=1e-4
        )
