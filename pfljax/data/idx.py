"""Fashion-MNIST (or any MNIST-layout data set) read from IDX files.

The IDX format (LeCun's MNIST format) is a big-endian header followed by the
raw array: two zero bytes, a type code, the number of dimensions, one int32
per dimension, then the data. Files may be gzip-compressed (`.gz`) or raw.

The Debian package `dataset-fashion-mnist` installs the four Fashion-MNIST
files in `/usr/share/datasets/fashion-mnist/`, the default directory here.
"""

from __future__ import annotations

import gzip
import os

import numpy as np

DEFAULT_FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist/"

FASHION_MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}

# Pixel scales of uint8 images (`pixel_levels`): "unit" x / 255 in [0, 1];
# "symmetric" (x / 255 - 0.5) / 0.5 in [-1, 1], torchvision's ToTensor() then
# Normalize(0.5, 0.5) (PFLlib's Fashion-MNIST transform), float32 op for op.
PIXEL_SCALES = ("unit", "symmetric")

FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)

# IDX type code -> big-endian numpy dtype.
_IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_idx(path: str) -> np.ndarray:
    """Reads one IDX file (gzip-compressed or raw).

    Args:
      path: file path; gzip is detected from the file's magic bytes.

    Returns:
      The array with the shape and dtype stored in the header (native byte
      order), e.g. uint8 [60000, 28, 28] for Fashion-MNIST training images.

    Raises:
      ValueError: the file is not a valid IDX file.
    """
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic number).")
    dtype, ndim = _IDX_DTYPES[raw[2]], raw[3]
    shape = tuple(np.frombuffer(raw, ">i4", count=ndim, offset=4))
    offset = 4 + 4 * ndim
    size = int(np.prod(shape, dtype=np.int64))
    if len(raw) - offset != size * dtype.itemsize:
        raise ValueError(f"{path}: header says shape {shape} but the payload has {len(raw) - offset} bytes.")
    data = np.frombuffer(raw, dtype, count=size, offset=offset).reshape(shape)
    return data.astype(dtype.newbyteorder("="))


def _find_file(data_dir: str, stem: str) -> str | None:
    for name in (stem + ".gz", stem):
        path = os.path.join(data_dir, name)
        if os.path.isfile(path):
            return path
    return None


def check_idx_dir(data_dir: str | None) -> str:
    """Checks that `data_dir` holds the four Fashion-MNIST IDX files.

    Args:
      data_dir: directory to check; None means DEFAULT_FASHION_MNIST_DIR.

    Returns:
      The directory that was checked.

    Raises:
      ValueError: naming `data_dir`, if it does not exist or lacks a file.
    """
    data_dir = DEFAULT_FASHION_MNIST_DIR if data_dir is None else str(data_dir)
    expected = ", ".join(f"{s}[.gz]" for s in FASHION_MNIST_FILES.values())
    if not os.path.isdir(data_dir):
        raise ValueError(
            f"data_dir={data_dir!r} is not a directory; expected a directory "
            f"holding the Fashion-MNIST IDX files {expected} (Debian package "
            f"dataset-fashion-mnist installs them in "
            f"{DEFAULT_FASHION_MNIST_DIR})."
        )
    missing = [s for s in FASHION_MNIST_FILES.values() if _find_file(data_dir, s) is None]
    if missing:
        raise ValueError(f"data_dir={data_dir!r} lacks the IDX files {missing}; expected {expected}.")
    return data_dir


def pixel_levels(pixel_scale: str = "unit") -> np.ndarray:
    """[256] float32 value of each uint8 pixel code at `pixel_scale` (PIXEL_SCALES).

    "symmetric" computes, in float32 as torch does, x / 255 (ToTensor) then
    (x - 0.5) / 0.5 (Normalize(mean=0.5, std=0.5)).

    Raises:
      ValueError: naming `pixel_scale` and its allowed values.
    """
    if pixel_scale not in PIXEL_SCALES:
        raise ValueError(f"pixel_scale={pixel_scale!r} is unknown; allowed values: {PIXEL_SCALES}.")
    unit = np.arange(256, dtype=np.float32) / np.float32(255.0)
    if pixel_scale == "unit":
        return unit
    half = np.float32(0.5)
    return ((unit - half) / half).astype(np.float32)


def load_fashion_mnist(
    data_dir: str | None = None, *, standardize: bool = False, codes: bool = False, pixel_scale: str = "unit"
) -> dict[str, np.ndarray]:
    """Loads Fashion-MNIST from IDX files.

    Args:
      data_dir: directory holding the four IDX files (gzip or raw); None means
        DEFAULT_FASHION_MNIST_DIR.
      standardize: if True, subtract the training images' mean pixel and divide
        by their pixel standard deviation (one scalar each, from the train
        split only); otherwise pixels are at `pixel_scale`.
      pixel_scale: "unit" ([0, 1], the default) or "symmetric" ([-1, 1], PFLlib's
        ToTensor + Normalize(0.5, 0.5)); see `pixel_levels`. Not with standardize.
      codes: if True, `x_*` are the raw uint8 pixels [N, 28, 28, 1] and
        `levels` [256] float32 gives each pixel value's float (levels[x] equals
        the float32 arrays returned with codes=False, bit for bit).

    Returns:
      Dict with `x_train` float32 [60000, 28, 28, 1], `y_train` int32 [60000],
      `x_test` float32 [10000, 28, 28, 1], `y_test` int32 [10000], in file
      order; with `codes`, `x_*` uint8 and `levels` [256] float32.

    Raises:
      ValueError: naming `data_dir`, if the directory or a file is missing;
        naming `pixel_scale` for an unknown scale or one given with standardize.
    """
    if standardize and pixel_scale != "unit":
        raise ValueError(f"pixel_scale={pixel_scale!r} with standardize=True: give one or the other.")
    levels = pixel_levels(pixel_scale)
    data_dir = check_idx_dir(data_dir)
    arrays = {k: read_idx(_find_file(data_dir, s)) for k, s in FASHION_MNIST_FILES.items()}
    out = {}
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if images.shape[0] != labels.shape[0]:
            raise ValueError(
                f"data_dir={data_dir!r}: {split} split has "
                f"{images.shape[0]} images but "
                f"{labels.shape[0]} labels."
            )
        out[f"x_{split}"] = images.astype(np.uint8)[..., None]
        out[f"y_{split}"] = labels.astype(np.int32)
    if standardize:
        train = levels[out["x_train"]]
        mean, std = train.mean(), train.std()
        levels = ((levels - mean) / std).astype(np.float32)
    if codes:
        return {**out, "levels": levels}
    return {**out, **{f"x_{s}": levels[out[f"x_{s}"]] for s in ("train", "test")}}
