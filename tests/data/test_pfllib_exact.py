"""pfllib_fmnist.py's `:dir` and `:pat` give PFLlib's own Fashion-MNIST clients, exactly.

The fixture was written by PFLlib's generator (tests/data/fixtures/README.md: the
commands); here the configs' data are built as every run builds them (config.make_data)
and compared client by client: the train and test index sets into the merged 70000
images, the per-class counts, and the pixels (PFLlib's [-1, 1] floats, bit for bit) and
labels of every row in PFLlib's file order. The partition and split only, no training.
"""

import functools
import hashlib
import json
import os

import numpy as np
import pytest

from pfljax.data import idx, sources
from pfljax.experiment import config as config_lib
from pfljax.experiment.configs import pfllib_fmnist

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "pfllib_fmnist_clients.json")
IDX_DIR = idx.DEFAULT_FASHION_MNIST_DIR
HAVE_IDX = all(
    os.path.isfile(os.path.join(IDX_DIR, name + ".gz")) for name in idx.FASHION_MNIST_FILES.values()
)
needs_idx = pytest.mark.skipif(
    not HAVE_IDX,
    reason=f"Fashion-MNIST IDX files absent from {IDX_DIR} (Debian package dataset-fashion-mnist)",
)


@functools.cache
def fixture() -> dict:
    with open(FIXTURE) as f:
        return json.load(f)


def sha(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def client_rows(pool) -> list[tuple[np.ndarray, np.ndarray]]:
    """(x as float32 values, y) of every client of a ClientPool, in its row order."""
    x, y, off, cnt = (np.asarray(a) for a in (pool.x, pool.y, pool.offset, pool.count))
    levels = None if pool.levels is None else np.asarray(pool.levels)
    rows = [slice(o, o + n) for o, n in zip(off, cnt, strict=True)]
    return [(x[r] if levels is None else levels[x[r]], y[r]) for r in rows]


@functools.cache
def raw_idx() -> dict:
    """The IDX files as uint8 codes (idx.load_fashion_mnist)."""
    return idx.load_fashion_mnist(IDX_DIR, codes=True)


@functools.cache
def built(setting: str, indices: bool) -> dict:
    """{"train": ..., "test": ...} client rows of the config's data; with `indices`, x
    is each row's merged index (a source of the same labels whose x is 0..69999)."""
    config = pfllib_fmnist.get_config(setting)
    config.data_dir = IDX_DIR
    if not indices:
        fd = config_lib.make_data(config)
    else:
        d = raw_idx()
        n_train, n = len(d["y_train"]), len(d["y_train"]) + len(d["y_test"])
        at = np.arange(n, dtype=np.float32)[:, None]  # exact in float32
        pooled = sources.Pooled(at[:n_train], d["y_train"], at[n_train:], d["y_test"], 10)
        config.dataset, config.source.pixel_scale = "pfllib_merged_index", None
        sources.SOURCES[config.dataset] = sources.SourceSpec(lambda **kwargs: pooled, False, 10)
        try:
            fd = config_lib.make_data(config)
        finally:
            del sources.SOURCES[config.dataset]
    return {"train": client_rows(fd.data.train), "test": client_rows(fd.data.test)}


def test_pfllib_configs_use_the_pfllib_mode():
    for setting in pfllib_fmnist.SETTINGS:
        config = pfllib_fmnist.get_config(setting)
        assert (config.test_split, config.source.pixel_scale, config.drop_last) == (
            "pfllib",
            "symmetric",
            True,
        )
        assert config_lib.make_local(config).drop_last


def test_symmetric_pixel_scale_is_pfllibs_transform_bit_for_bit():
    """idx.pixel_levels("symmetric") is torchvision's ToTensor + Normalize(0.5, 0.5) of
    each of the 256 pixel codes, as the oracle computed it; "unit" is the old x / 255."""
    want = np.asarray(fixture()["levels"], np.float32)
    got = idx.pixel_levels("symmetric")
    assert got.dtype == np.float32 and want.shape == (256,)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(idx.pixel_levels("unit"), np.arange(256, dtype=np.float32) / 255.0)
    assert (got.min(), got.max()) == (-1.0, 1.0)


@needs_idx
@pytest.mark.parametrize("setting", ["dir", "pat"])
def test_pfllib_mode_clients_are_pfllibs_index_sets(setting):
    """Every client's train and test index set (into the merged 70000) is PFLlib's."""
    clients = fixture()["splits"][setting]
    got = built(setting, indices=True)
    for part in ("train", "test"):
        assert len(got[part]) == len(clients) == 20
        for c, ((at, y), want) in enumerate(zip(got[part], clients, strict=True)):
            index = at[:, 0].astype(np.int64)
            assert np.bincount(y, minlength=10).tolist() == want[f"{part}_class_counts"], (c, part)
            assert sha(np.sort(index).astype("<i8")) == want[f"{part}_index_sha256"], (c, part)


@needs_idx
@pytest.mark.parametrize("setting", ["dir", "pat"])
def test_pfllib_mode_clients_hold_pfllibs_files_rows(setting):
    """Each client's pixels ([-1, 1] float32, bit for bit) and labels are PFLlib's
    client files', row for row in the files' order."""
    clients = fixture()["splits"][setting]
    got = built(setting, indices=False)
    for part in ("train", "test"):
        for c, ((x, y), want) in enumerate(zip(got[part], clients, strict=True)):
            assert x.dtype == np.float32 and x.shape[1:] == (28, 28, 1), (c, part)
            assert sha(x.astype("<f4"), y.astype("<i8")) == want[f"{part}_data_sha256"], (c, part)


@needs_idx
def test_a_few_images_have_pfllibs_pixel_values():
    """A few rows of PFLlib's client files, by value: merged index, sum, min, max and
    the middle image row, against the same rows of pfljax's clients."""
    for sample in fixture()["images"]:
        setting, c, part, row = (sample[k] for k in ("setting", "client", "part", "row"))
        x = built(setting, indices=False)[part][c][0][row, :, :, 0]
        assert int(built(setting, indices=True)[part][c][0][row, 0]) == sample["index"]
        assert (float(x.min()), float(x.max())) == (sample["min"], sample["max"])
        np.testing.assert_array_equal(x[14], np.asarray(sample["row_14"], np.float32))
        np.testing.assert_allclose(x.astype(np.float64).sum(), sample["sum"], rtol=1e-12)
        raw, i, n_train = raw_idx(), sample["index"], 60000
        code = (raw["x_train"][i] if i < n_train else raw["x_test"][i - n_train])[14, :, 0]
        # (code / 255 - 0.5) / 0.5, written out: PFLlib's transform of the raw IDX pixels
        np.testing.assert_allclose(x[14], code / 127.5 - 1.0, rtol=0, atol=1e-6)
