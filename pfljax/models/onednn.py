"""oneDNN's convolutions and LSTM layers inside XLA:CPU programs, built on first use.

XLA:CPU (jaxlib 0.10) runs a convolution's gradients inside the local-training loop through
Eigen or as im2col matmuls (see `pfljax.models.conv`), and an LSTM as one small task per
operation of every time step (see `pfljax.models.lstm`); oneDNN, the library PyTorch's CPU
convolutions and LSTMs call, runs them faster. `onednn.cc` wraps oneDNN's three convolution
products (forward, input gradient, kernel gradient; float32, NHWC / HWIO) and its LSTM layer
(inference, training forward, backward; float32, time-major) as XLA FFI handlers. On first
use it is compiled against jaxlib's FFI headers and the system's oneDNN (Debian / Ubuntu:
`apt-get install g++ libdnnl-dev`; CXX, CPATH and LIBRARY_PATH are honoured) into
`cache_dir()`, once per source and jaxlib version, under a file lock (parallel test workers
build it once). Where that fails, `available()` is False, `unavailable_reason()` says why, and
`conv_impl="auto"` keeps `im2col_nn` (`CharLSTM(impl="auto")` keeps "scan"). oneDNN's OpenMP
threads per call: the process's cores shared among its CPU devices (`threads_per_call`; with
`--cpu_devices=2` on 2 cores, one each: without that, two devices' teams of two threads on two
cores made rounds 2-3x slower).

`conv2d` has a custom VJP whose gradients are oneDNN's; each of the three products has a custom
JVP (each is bilinear), so forward-over-reverse (Per-FedAvg's Hessian-vector product) works.
Reverse-over-reverse and a JVP of the output are refused by JAX. `lstm` has a custom VJP
(oneDNN's backward, from the workspace its training forward leaves); reverse mode only. Under
`vmap` every call runs once per mapped element (`vmap_method="sequential"`), which is what
clients with their own weights need.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from absl import logging

SOURCE = Path(__file__).with_name("onednn.cc")
# FFI target name -> symbol in the built library.
TARGETS = {
    "pfljax_onednn_conv_forward": "PfljaxConvForward",
    "pfljax_onednn_conv_input_grad": "PfljaxConvInputGrad",
    "pfljax_onednn_conv_kernel_grad": "PfljaxConvKernelGrad",
    "pfljax_onednn_lstm_inference": "PfljaxLstmInference",
    "pfljax_onednn_lstm_training": "PfljaxLstmTraining",
    "pfljax_onednn_lstm_backward": "PfljaxLstmBackward",
}


def cache_dir() -> Path:
    """$PFLJAX_CACHE_DIR, else $XDG_CACHE_HOME/pfljax, else ~/.cache/pfljax."""
    if os.environ.get("PFLJAX_CACHE_DIR"):
        return Path(os.environ["PFLJAX_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pfljax"


def _compiler() -> str:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise OSError("no C++ compiler (c++ or g++ on PATH, or CXX): apt-get install g++")
    return compiler


def build() -> Path:
    """The shared library, compiled into cache_dir() unless already there."""
    compiler = _compiler()
    key = hashlib.sha256(SOURCE.read_bytes() + f"{jaxlib.__version__} {compiler}".encode()).hexdigest()[:16]
    directory = cache_dir()
    library = directory / f"onednn-{key}.so"
    if library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "onednn.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists():  # built by another process while this one waited
            return library
        partial = library.with_suffix(f".{os.getpid()}.tmp")
        command = [
            compiler,
            "-O2",
            "-std=c++17",
            "-shared",
            "-fPIC",
            "-fopenmp",
            f"-I{jax.ffi.include_dir()}",
        ]
        command += [str(SOURCE), "-o", str(partial), "-ldnnl"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            lines = done.stderr.splitlines()
            first = next((line for line in lines if "error" in line), lines[0] if lines else done.returncode)
            hint = " (oneDNN headers: apt-get install libdnnl-dev)" if "dnnl" in done.stderr else ""
            raise OSError(f"building {SOURCE.name} failed{hint}: {first}")
        os.replace(partial, library)
    return library


@functools.cache
def _load() -> str:
    """Builds, loads and registers the FFI targets once per process; '' or why it failed."""
    try:
        library = _library()
    except OSError as error:
        return str(error)
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    return ""


@functools.cache
def _library() -> ctypes.CDLL:
    return ctypes.CDLL(str(build()))


def threads_per_call() -> int:
    """This process's cores shared among its CPU devices (`--cpu_devices`), which run their
    clients at the same time: each oneDNN call's OpenMP threads."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // jax.local_device_count("cpu"))


def available() -> bool:
    """Whether oneDNN's convolutions and LSTM could be built and loaded in this process."""
    return not _load()


def unavailable_reason() -> str:
    """Why `available()` is False ('' when it is True)."""
    return _load()


@functools.cache
def available_or_log() -> bool:
    """`available()`, logging why not, once (the "auto" impls' choice on CPU)."""
    if available():
        return True
    logging.info(
        "oneDNN is not available (conv_impl 'auto' runs im2col_nn, CharLSTM impl 'auto' runs scan): %s",
        unavailable_reason(),
    )
    return False


def _call(target: str, shape, *operands, window):
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(shape, jnp.float32), vmap_method="sequential")
    return call(*operands, window=np.array(window, np.int64))


def _out_shape(x_shape, kernel_shape, window) -> tuple[int, ...]:
    sh, sw, pt, pb, pl, pr = window
    kh, kw, _, cout = kernel_shape
    return (x_shape[0], (x_shape[1] + pt + pb - kh) // sh + 1, (x_shape[2] + pl + pr - kw) // sw + 1, cout)


# The three products, each bilinear in its two operands; `window` = (sh, sw, pt, pb, pl, pr).
@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _forward(x, kernel, window):
    shape = _out_shape(x.shape, kernel.shape, window)
    return _call("pfljax_onednn_conv_forward", shape, x, kernel, window=window)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _input_grad(dy, kernel, window, x_shape):
    return _call("pfljax_onednn_conv_input_grad", x_shape, dy, kernel, window=window)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _kernel_grad(x, dy, window, kernel_shape):
    return _call("pfljax_onednn_conv_kernel_grad", kernel_shape, x, dy, window=window)


@_forward.defjvp
def _forward_jvp(window, primals, tangents):
    (x, kernel), (dx, dkernel) = primals, tangents
    return _forward(x, kernel, window), _forward(dx, kernel, window) + _forward(x, dkernel, window)


@_input_grad.defjvp
def _input_grad_jvp(window, x_shape, primals, tangents):
    (dy, kernel), (ddy, dkernel) = primals, tangents
    value = _input_grad(dy, kernel, window, x_shape)
    return value, _input_grad(ddy, kernel, window, x_shape) + _input_grad(dy, dkernel, window, x_shape)


@_kernel_grad.defjvp
def _kernel_grad_jvp(window, kernel_shape, primals, tangents):
    (x, dy), (dx, ddy) = primals, tangents
    value = _kernel_grad(x, dy, window, kernel_shape)
    return value, _kernel_grad(dx, dy, window, kernel_shape) + _kernel_grad(x, ddy, window, kernel_shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _conv(x, kernel, window):
    return _forward(x, kernel, window)


def _conv_fwd(x, kernel, window):
    return _forward(x, kernel, window), (x, kernel)


def _conv_bwd(window, residuals, dy):
    x, kernel = residuals
    return _input_grad(dy, kernel, window, x.shape), _kernel_grad(x, dy, window, kernel.shape)


_conv.defvjp(_conv_fwd, _conv_bwd)


def conv2d(x: jax.Array, kernel: jax.Array, strides, pads) -> jax.Array:
    """x [N, H, W, Cin] (float32), kernel [kh, kw, Cin, Cout], strides (sh, sw), pads
    ((top, bottom), (left, right)) -> [N, H', W', Cout], by oneDNN (see the module docstring)."""
    if not available():
        raise RuntimeError(f"conv impl 'onednn' is not available: {unavailable_reason()}")
    if x.dtype != jnp.float32 or kernel.dtype != jnp.float32:
        raise ValueError(f"conv impl 'onednn' takes float32 only, got {x.dtype} and {kernel.dtype}")
    _share_cores()
    window = (*map(int, strides), *map(int, pads[0]), *map(int, pads[1]))
    return _conv(x, kernel, window)


@functools.cache
def _share_cores() -> None:
    """Once JAX's devices exist (at the first trace): each call's OpenMP threads."""
    _library().PfljaxOnednnSetThreads(threads_per_call())


# ---------------------------------------------------------------- LSTM


@functools.cache
def _workspace_bytes(steps: int, batch: int, width: int, hidden: int) -> int:
    bytes_ = _library().PfljaxLstmWorkspaceBytes
    bytes_.restype = ctypes.c_int64
    size = bytes_(*(ctypes.c_int64(v) for v in (steps, batch, width, hidden)))
    if size < 0:
        raise ValueError(f"oneDNN refuses an LSTM layer of {steps} steps, batch {batch}, {width} -> {hidden}")
    return size


def _lstm_call(target: str, shapes, *operands):
    results = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    return jax.ffi.ffi_call(target, results, vmap_method="sequential")(*operands)


@jax.custom_vjp
def _lstm(x, wi, wh, bias):
    (hs,) = _lstm_call(
        "pfljax_onednn_lstm_inference", [(x.shape[:2] + wh.shape[:1], jnp.float32)], x, wi, wh, bias
    )
    return hs


def _lstm_fwd(x, wi, wh, bias):
    steps, batch, width = x.shape
    shapes = [
        ((steps, batch, wh.shape[0]), jnp.float32),
        ((_workspace_bytes(steps, batch, width, wh.shape[0]),), jnp.uint8),
    ]
    hs, workspace = _lstm_call("pfljax_onednn_lstm_training", shapes, x, wi, wh, bias)
    return hs, (x, wi, wh, bias, hs, workspace)


def _lstm_bwd(residuals, dhs):
    x, wi, wh, bias, hs, workspace = residuals
    shapes = [(a.shape, jnp.float32) for a in (x, wi, wh, bias)]
    return tuple(_lstm_call("pfljax_onednn_lstm_backward", shapes, x, wi, wh, bias, hs, workspace, dhs))


_lstm.defvjp(_lstm_fwd, _lstm_bwd)


def lstm(x: jax.Array, wi: jax.Array, wh: jax.Array, bias: jax.Array) -> jax.Array:
    """Hidden states hs [T, B, H] of one LSTM layer from zero state on time-major inputs
    x [T, B, in] (float32): input kernel wi [in, 4H], recurrent kernel wh [H, 4H] and bias [4H],
    the gates (i, f, g, o) side by side, as `pfljax.models.lstm.lstm_scan` takes them; by oneDNN
    (see the module docstring)."""
    if not available():
        raise RuntimeError(f"LSTM impl 'onednn' is not available: {unavailable_reason()}")
    if any(a.dtype != jnp.float32 for a in (x, wi, wh, bias)):
        raise ValueError("LSTM impl 'onednn' takes float32 only")
    _share_cores()
    return _lstm(x, wi, wh, bias)
