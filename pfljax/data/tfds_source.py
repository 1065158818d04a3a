"""Any TensorFlow Datasets (TFDS) image data set, read offline from a data_dir.

`load_tfds("cifar10", data_dir)` reads an already prepared data set with
`download=False` and returns numpy arrays: images NHWC, float32 in [0, 1]
(or standardized), or with `codes=True` uint8 images and a 256-entry table of
their float values (what `sources` asks for, so pools stay uint8).
TensorFlow and tensorflow_datasets are imported inside the functions only, so
importing pfljax never imports TensorFlow.

Offline preparation from local files (`prepare_tfds_from_files`). TFDS 4.9
looks for manually downloaded files in `DownloadConfig(manual_dir=...)` under
the file names of its registered checksums, and then verifies their sha256.
The Debian copies of Fashion-MNIST are the same IDX payloads re-gzipped
without the original file name and time stamp in the gzip header (each file
is exactly len(name) + 1 bytes shorter), so their sha256 differs from TFDS's
and `manual_dir` fails with NonMatchingChecksumError. What works offline is
TFDS's own download cache: a file stored at
`<data_dir>/downloads/<dataset>/<resource.get_dl_fname(url, checksum)>` with a
`.INFO` file beside it counts as already downloaded and is not re-hashed. We
copy each local file there (the `.INFO` records the file's real size and
sha256) and call `builder.download_and_prepare` with `try_download_gcs=False`;
TFDS then extracts and converts the files as it would after a download. This
works for any TFDS data set whose downloads are plain files listed in its
checksums (mnist, fashion_mnist, kmnist, ...).
"""

from __future__ import annotations

import difflib
import os
import shutil

import numpy as np


def _import_tfds():
    import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

    return tfds


def _builder(name: str, data_dir: str | None):
    tfds = _import_tfds()
    try:
        return tfds.builder(name, data_dir=data_dir)
    except Exception as e:  # DatasetNotFoundError and friends
        raise ValueError(_builder_error(tfds, name, e)) from e


def _builder_error(tfds, name: str, e: BaseException) -> str:
    """One short line for tfds.builder's error: an unknown name gets at most 3 close
    names and a count (TFDS's own message lists all ~450 data sets), others their first line."""
    if type(e).__name__ != "DatasetNotFoundError":
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return f"dataset='tfds:{name}': tensorflow_datasets cannot build it: {first[:300]}"
    try:
        names = [str(n) for n in tfds.list_builders()]
    except Exception:  # noqa: BLE001  no suggestions then
        names = []
    base = name.split("/")[0].split(":")[0]
    close = difflib.get_close_matches(base, names, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    return (
        f"dataset='tfds:{name}' is not a TFDS data set known to tensorflow_datasets "
        f"({hint}{len(names)} known: tfds.list_builders())"
    )


def prepare_tfds_from_files(name: str, data_dir: str, files_dir: str) -> None:
    """Prepares TFDS data set `name` in `data_dir` from local files, offline.

    Args:
      name: TFDS name, e.g. "fashion_mnist".
      data_dir: TFDS data directory to prepare into.
      files_dir: directory holding the files TFDS would download, under the
        file names of TFDS's checksums (for fashion_mnist:
        train-images-idx3-ubyte.gz, ...; the Debian package
        dataset-fashion-mnist has them in /usr/share/datasets/fashion-mnist).

    Raises:
      ValueError: naming `files_dir` if a needed file is missing, or
        `dataset` if TFDS does not know `name` or lists no plain-file
        downloads for it.
    """
    tfds = _import_tfds()
    from tensorflow_datasets.core.download import (
        checksums,  # pylint: disable=import-outside-toplevel
        resource,  # pylint: disable=import-outside-toplevel
    )

    builder = _builder(name, data_dir)
    url_infos = builder.url_infos or {}
    if not url_infos:
        raise ValueError(
            f"dataset='tfds:{name}': TFDS lists no download files "
            f"for it, so it cannot be prepared from files_dir."
        )
    download_dir = os.path.join(data_dir, "downloads", builder.name)
    os.makedirs(download_dir, exist_ok=True)
    for url, info in url_infos.items():
        src = os.path.join(files_dir, info.filename or "")
        if not info.filename or not os.path.isfile(src):
            raise ValueError(
                f"files_dir={files_dir!r} lacks {info.filename!r}, needed to "
                f"prepare tfds:{name} offline; expected "
                f"{sorted(i.filename for i in url_infos.values())}."
            )
        dst = os.path.join(download_dir, resource.get_dl_fname(url, info.checksum))
        shutil.copyfile(src, dst)
        resource.write_info_file(
            url=url,
            path=tfds.core.Path(dst),
            dataset_name=builder.name,
            original_fname=info.filename,
            url_info=checksums.compute_url_info(src),
        )
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(try_download_gcs=False))


def load_tfds(
    name: str,
    data_dir: str | None = None,
    *,
    splits: tuple[str, ...] = ("train", "test"),
    prepare_from: str | None = None,
    standardize: bool = False,
    codes: bool = False,
) -> dict:
    """Reads a prepared TFDS image classification data set into numpy.

    Args:
      name: TFDS name, e.g. "cifar10", "fashion_mnist", "emnist/balanced".
      data_dir: TFDS data directory (None: TFDS's default, ~/tensorflow_datasets).
      splits: splits to read; each must exist.
      prepare_from: if the data set is not prepared in `data_dir`, prepare it
        offline from this directory of downloaded files first (see
        `prepare_tfds_from_files`).
      standardize: subtract the first split's mean pixel and divide by its
        pixel standard deviation (scalars) instead of only scaling to [0, 1].
      codes: if True and the images are uint8, `x_s` stay uint8 and `levels`
        [256] float32 gives each pixel value's float (levels[x] equals the float
        images returned with codes=False, bit for bit).

    Returns:
      Dict with, for each split s, `x_s` float32 [N_s, H, W, C] (or uint8 with
      `codes`) and `y_s` int32 [N_s], plus `num_classes` (int), `class_names`
      (list of str) and `levels` ([256] float32, or None).

    Raises:
      ValueError: naming `data_dir` if the data set is not prepared there (and
        `prepare_from` is None), `dataset` if TFDS does not know it, or
        `splits` if a split is missing.
    """
    tfds = _import_tfds()
    builder = _prepared_builder(name, data_dir, prepare_from)
    info = builder.info
    missing = [s for s in splits if s not in info.splits]
    if missing:
        raise ValueError(
            f"splits={splits!r}: tfds:{name} has no split {missing}; it has {sorted(info.splits)}."
        )
    image_key, label_key = info.supervised_keys or ("image", "label")
    out: dict = {}
    for split in splits:
        data = tfds.as_numpy(builder.as_dataset(split=split, batch_size=-1, shuffle_files=False))
        out[f"x_{split}"], out[f"y_{split}"] = data[image_key], data[label_key].astype(np.int32)
    out["levels"] = _pixel_values(out, splits, standardize=standardize, codes=codes)
    label_feature = info.features[label_key]
    out["num_classes"] = int(label_feature.num_classes)
    out["class_names"] = list(label_feature.names)
    return out


def _prepared_builder(name: str, data_dir: str | None, prepare_from: str | None):
    """TFDS's builder of `name`, prepared in data_dir (from `prepare_from` if it is not)."""
    builder = _builder(name, data_dir)
    if not builder.is_prepared():
        if prepare_from is None:
            raise ValueError(
                f"data_dir={data_dir!r} holds no prepared tfds:{name} "
                f"(looked in {builder.data_dir}); prepare it first, e.g. "
                f"`tfds build {name} --data_dir=...` where a network is "
                f"available, or prepare_tfds_from_files(name, data_dir, "
                f"files_dir) / load_source(..., prepare_from=files_dir)."
            )
        prepare_tfds_from_files(name, builder.data_dir_root, prepare_from)
        builder = _builder(name, data_dir)
    return builder


def _pixel_values(out: dict, splits: tuple[str, ...], *, standardize: bool, codes: bool):
    """Turns out's raw `x_<split>` images into float32 values in place (scaled to [0, 1],
    or standardized by the first split's pixel mean and std), unless `codes` and they
    are uint8: then they stay codes. Returns the [256] float32 levels of the codes
    (None where x holds the values)."""
    quantized = all(out[f"x_{s}"].dtype == np.uint8 for s in splits)
    levels = np.arange(256, dtype=np.float32) / 255.0 if quantized else None
    value = lambda x: levels[x] if quantized else x.astype(np.float32)  # noqa: E731
    if standardize:
        first = value(out[f"x_{splits[0]}"])
        mean, std = first.mean(), first.std()
        if quantized:
            levels = ((levels - mean) / std).astype(np.float32)
        else:
            value = lambda x: ((x.astype(np.float32) - mean) / std).astype(np.float32)  # noqa: E731
    if codes and quantized:
        return levels
    out.update({f"x_{s}": value(out[f"x_{s}"]) for s in splits})
    return None
