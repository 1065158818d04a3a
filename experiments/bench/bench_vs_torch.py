"""One FedAvg round in pfljax against the same round the PyTorch-library way.

    python -m experiments.bench.bench_vs_torch [--cases=cnn,mlp,fedavgcnn,refcnn,resnet9,lstm]
        [--clients=10,100] [--split=equal|dirichlet|both] [--rows=0] [--epochs=1]
        [--repeats=3] [--torch_threads=0] [--devices=1[,2]] [--conv_impl=auto[,im2col,...]]
        [--lstm_impl=scan[,flax]]

Needs PyTorch (`pip install -e .[bench]`); pfljax itself never imports it.

For each case and client count, two rounds of the same work are timed,
interleaved (pfljax, torch, pfljax, torch, ...), after one untimed warm-up round
each (pfljax's includes compilation); pfljax runs in this process, torch in a
spawned process of its own (`TorchSide`), so that neither side's threads or
libraries change the other's time (oneDNN calls inside XLA programs slowed later
torch rounds in the same process by up to 1.7x):

- pfljax: `fedavg.build(...).round` jitted, every client's E local epochs in one
  XLA program (clients mapped by the library's "auto" strategy); with
  `--devices=D` on CPU, D host devices are forced (`jax_num_cpu_devices`, the
  binaries' `--cpu_devices`) and the clients sharded over them as the binaries do
  (`pfljax.runtime.sharding.ShardedMap`, `shard_algorithm`): D clients at a time, one per core
  (`--devices=1,2`: a row for each in the same process, the largest count forced);
  `--conv_impl=im2col,auto`: a row per convolution (pfljax.models.conv.IMPLS) in the
  conv cases, their rounds interleaved with each other and the torch round (before/after
  figures from one run, sharing one torch timing); `--lstm_impl=scan,auto` likewise a row
  per way of running the char LSTM (pfljax.models.lstm.IMPLS) in the `lstm` case;
- torch: what FL-bench and PFLlib do: for each client in turn, load the global
  weights into the model, make a fresh `torch.optim.SGD`, run E epochs over the
  client's own `DataLoader(TensorDataset, batch_size=B, shuffle=True)`, keep a
  copy of its state_dict; then average the state_dicts on the host, weighted by
  client sizes.

Same model (layer by layer; the torch modules below are written to the flax
models' layouts), same client sizes, batch size, epochs and plain SGD (lr 0.01,
no momentum), same loss. Data are random arrays of the right shapes (throughput
only; for the LSTM, windows of random character ids, one in eight ending in
padding); `--split=dirichlet` draws unequal client sizes from a Dirichlet(0.1)
label split (pfljax.data.partition.dirichlet) of random labels.

Each JSON line gives seconds per round (median, min, max over repeats), samples
per second (real samples: E * sum of client sizes), the ratio torch / pfljax of
median times, the round's FLOPs counted by hand (forward multiply-adds x 2,
training step = 3 x forward: forward, and a backward of about twice the forward;
the LSTM's at every time step), the achieved GFLOP/s of both sides as a fraction
of a float32 2048^3 matmul peak measured in the same process by each framework,
XLA's own cost count of one training step per sample for comparison, and the
machine's load average.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from pfljax.algorithms import fedavg
from pfljax.core.clients import take
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.losses import PAD_ID
from pfljax.core.types import ClientData
from pfljax.data.federated import pad_clients
from pfljax.data.partition import dirichlet
from pfljax.experiment.cli import fail, missing_package, parse_flags
from pfljax.models import build_model
from pfljax.models.conv import IMPLS, ONEDNN_MISSING, resolve_impl, runs_here
from pfljax.models.lstm import IMPLS as LSTM_IMPLS
from pfljax.models.lstm import resolve_impl as resolve_lstm_impl
from pfljax.models.weights import layer_order
from pfljax.runtime.sharding import ShardedMap, client_mesh, shard_algorithm, use_cpu_devices

FLAGS = flags.FLAGS
# rows: per client (one epoch = rows / batch steps). Sizes are kept small enough
# that a round of every case fits a loaded 2-core CPU; raise --rows on a GPU.
CASES = {
    # experiments/bench/bench.py's "cnn": pfljax's default CNN (16, 32 channels of 5x5 VALID, dense 100).
    "cnn": dict(model="cnn", input_shape=(28, 28, 1), classes=10, rows=320, batch=32, kwargs={}),
    # experiments/bench/bench.py's "mlp": the FedFac simulation MLP d=100, one hidden layer of 200.
    "mlp": dict(model="mlp", input_shape=(100,), classes=2, rows=640, batch=32, kwargs={"hidden": (200,)}),
    # PFLlib's FedAvgCNN (system/flcore/trainmodel/models.py): 32, 64 channels of 5x5 with no
    # padding, each ReLU + 2x2 max pool, Linear(1024, 512) + ReLU, Linear(512, classes).
    "fedavgcnn": dict(
        model="cnn",
        input_shape=(28, 28, 1),
        classes=10,
        rows=100,
        batch=10,
        kwargs={"channels": (32, 64), "dense": (512,)},
    ),
    # The CNN of ../shared/reference/torch_loop_cnn.py (its 4,559 samples/s figure): 5x5 'SAME'
    # convolutions (16, 32 channels), dense 128; about 2.7x the bench CNN's FLOPs per sample.
    "refcnn": dict(
        model="cnn",
        input_shape=(28, 28, 1),
        classes=10,
        rows=320,
        batch=32,
        kwargs={"padding": "SAME", "dense": (128,)},
    ),
    # pfljax's ResNet-9 (the Factorized-FL network, BatchNorm in train mode).
    "resnet9": dict(model="resnet9", input_shape=(32, 32, 3), classes=10, rows=32, batch=32, kwargs={}),
    # The Shakespeare char-LSTM (pfljax/models/lstm.py; configs/tff_shakespeare.py): 80-character
    # windows, embedding 8, two LSTM layers of 256, logits over a vocabulary of 80 at every
    # position, per-token cross-entropy with padding (id 0) masked. LEAF's batch of 10; 20
    # windows per client (2 steps): 78 GFLOP a round at 10 clients, seconds on a loaded 2-core CPU.
    "lstm": dict(
        model="char_lstm",
        input_shape=(80,),
        classes=80,
        rows=20,
        batch=10,
        kwargs={"embed": 8, "hidden": (256, 256), "last_only": False},
        loss="token_cross_entropy",
    ),
}


# ---------------------------------------------------------------- FLOPs by hand


def forward_flops(name: str, spec: dict) -> float:
    """Forward FLOPs of one sample (2 x multiply-adds of convolutions and dense
    layers; bias, ReLU, pooling and BatchNorm are left out, under 1%)."""
    kw = spec["kwargs"]
    if spec["model"] == "char_lstm":
        # Per time step: each layer's four gates, 4 H (in + H); the head H V; the embedding
        # is a lookup. (Gate nonlinearities and products, ~10 H per layer, are left out.)
        width, macs = kw["embed"], 0
        for hid in kw["hidden"]:
            macs += 4 * hid * (width + hid)
            width = hid
        steps = spec["input_shape"][0]
        return 2.0 * steps * (macs + width * spec["classes"])
    h, w, cin = spec["input_shape"] if len(spec["input_shape"]) == 3 else (1, 1, spec["input_shape"][0])
    macs = 0
    if name == "mlp":
        width = cin
        for out in (*kw["hidden"], spec["classes"]):
            macs += width * out
            width = out
        return 2.0 * macs
    if spec["model"] == "cnn":
        same = kw.get("padding", "VALID") == "SAME"
        for ch in kw.get("channels", (16, 32)):
            h, w = (h, w) if same else (h - 4, w - 4)  # 5x5 convolutions
            macs += h * w * ch * 25 * cin
            h, w, cin = h // 2, w // 2, ch
        width = h * w * cin
        for out in (*kw.get("dense", (100,)), spec["classes"]):
            macs += width * out
            width = out
        return 2.0 * macs
    if name == "resnet9":
        from pfljax.models.resnet import LAYOUT

        widths = (64, 128, 256)
        for i, (wi, k, s, pad) in enumerate(LAYOUT):
            ch = widths[wi]
            if pad == "SAME":
                h, w = -(-h // s), -(-w // s)
            else:
                h, w = (h - k) // s + 1, (w - k) // s + 1
            macs += h * w * ch * k * k * cin
            cin = ch
            if i == 4:
                h, w = h // 2, w // 2
        return 2.0 * (macs + cin * spec["classes"])
    raise ValueError(f"no FLOP count for case {name!r}")


def xla_step_flops_per_sample(model, spec: LocalTraining, data) -> float:
    """XLA's cost analysis of one local step (forward + backward + update) / batch."""
    one = spec._replace(steps=1, epochs=None)
    train = make_local_train(model.apply, one)
    lowered = jax.jit(train).lower(model.init(jax.random.key(0)), take(data, 0), jax.random.key(0))
    cost = lowered.compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("flops", 0.0)) / spec.batch_size


def jax_matmul_peak(n: int = 2048, repeats: int = 5) -> float:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = min(_timed(lambda: f(a).block_until_ready()) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def torch_matmul_peak(n: int = 2048, repeats: int = 5) -> float:
    import torch

    a = torch.randn(n, n, device=torch_device())
    a @ a
    _sync()
    best = min(_timed(lambda: (a @ a, _sync())) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def _torch_peak_of(device: str, threads: int) -> float:
    global _DEVICE
    _DEVICE = device
    if threads:
        import torch

        torch.set_num_threads(threads)
    return torch_matmul_peak()


def torch_matmul_peak_apart(threads: int = 0) -> float:
    """torch_matmul_peak in a spawned process, so that this one never runs torch's kernels: its
    OpenMP threads, once started here, share their libgomp with the oneDNN calls of the XLA
    programs (one libgomp.so.1 per process) and made the char LSTM's oneDNN round 2-4x slower."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_torch_peak_of, (str(torch_device()), threads))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---------------------------------------------------------------- torch side


_DEVICE: str | None = None  # set in TorchSide's process: the parent's torch_device()


def torch_device():
    import torch

    if _DEVICE:
        return torch.device(_DEVICE)
    return torch.device("cuda" if torch.cuda.is_available() and jax.default_backend() == "gpu" else "cpu")


def _sync():
    import torch

    if torch_device().type == "cuda":
        torch.cuda.synchronize()


def torch_model(name: str, spec: dict):
    """The torch module of a case, written to the flax model's layout: NCHW inside,
    but features are flattened in NHWC order so that flax Dense kernels carry over
    (the char LSTM: flax_lstm_to_torch_state)."""
    import torch
    from torch import nn

    kw = spec["kwargs"]

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            sizes = (spec["input_shape"][0], *kw["hidden"])
            self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
            self.head = nn.Linear(sizes[-1], spec["classes"])

        def forward(self, x):
            x = x.flatten(1)
            for layer in self.hidden:
                x = torch.relu(layer(x))
            return self.head(x)

    class CNN(nn.Module):
        def __init__(self):
            super().__init__()
            chans = (spec["input_shape"][-1], *kw.get("channels", (16, 32)))
            pad = 2 if kw.get("padding", "VALID") == "SAME" else 0
            convs = (nn.Conv2d(a, b, 5, padding=pad) for a, b in zip(chans[:-1], chans[1:]))
            self.convs = nn.ModuleList(convs)
            side = spec["input_shape"][0]
            for _ in chans[1:]:
                side = (side - 4 + 2 * pad) // 2
            sizes = (side * side * chans[-1], *kw.get("dense", (100,)))
            self.dense = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
            self.head = nn.Linear(sizes[-1], spec["classes"])

        def forward(self, x):
            for conv in self.convs:
                x = torch.max_pool2d(torch.relu(conv(x)), 2)
            x = x.permute(0, 2, 3, 1).flatten(1)
            for layer in self.dense:
                x = torch.relu(layer(x))
            return self.head(x)

    class ResNet9(nn.Module):
        def __init__(self):
            super().__init__()
            from pfljax.models.resnet import LAYOUT

            widths, cin = (64, 128, 256), spec["input_shape"][-1]
            self.convs, self.bns = nn.ModuleList(), nn.ModuleList()
            for wi, k, s, pad in LAYOUT:
                p = (k - 1) // 2 if pad == "SAME" else 0
                self.convs.append(nn.Conv2d(cin, widths[wi], k, stride=s, padding=p, bias=False))
                self.bns.append(nn.BatchNorm2d(widths[wi], momentum=0.1, eps=1e-5))
                cin = widths[wi]
            self.head = nn.Linear(cin, spec["classes"])

        def cbr(self, x, i):
            return torch.relu(self.bns[i](self.convs[i](x)))

        def forward(self, x):
            x = self.cbr(self.cbr(x, 0), 1)
            x = x + self.cbr(self.cbr(x, 2), 3)
            x = torch.max_pool2d(self.cbr(x, 4), 2)
            x = x + self.cbr(self.cbr(x, 5), 6)
            return self.head(self.cbr(x, 7).amax(dim=(2, 3)))

    class CharLSTM(nn.Module):
        """The usual torch port of LEAF's Shakespeare model: nn.Embedding, one nn.LSTM of
        len(hidden) layers (batch_first), nn.Linear at every position (or the last).

        nn.LSTM has two bias vectors per layer, b_ih + b_hh, where flax's cell has one;
        trained both, the sum would take twice the step. b_ih is held at zero and frozen
        (not a parameter the optimizer sees), b_hh is flax's bias: the same model.
        """

        def __init__(self):
            super().__init__()
            widths = tuple(kw["hidden"])
            if len(set(widths)) != 1:
                raise ValueError(f"one nn.LSTM needs equal layer widths, got {widths}")
            self.embedding = nn.Embedding(spec["classes"], kw["embed"])
            self.lstm = nn.LSTM(kw["embed"], widths[0], num_layers=len(widths), batch_first=True)
            for k in range(len(widths)):
                bias = getattr(self.lstm, f"bias_ih_l{k}")
                nn.init.zeros_(bias)
                bias.requires_grad_(False)
            self.head = nn.Linear(widths[0], spec["classes"])
            self.last_only = kw.get("last_only", True)

        def forward(self, x):
            h, _ = self.lstm(self.embedding(x))
            return self.head(h[:, -1] if self.last_only else h)

    if name == "mlp":
        return MLP()
    if spec["model"] == "cnn":
        return CNN()
    if name == "resnet9":
        return ResNet9()
    if spec["model"] == "char_lstm":
        return CharLSTM()
    raise ValueError(f"no torch model for case {name!r}")


GATES = ("i", "f", "g", "o")  # torch.nn.LSTM's row blocks of weight_ih / weight_hh / biases


def flax_lstm_to_torch_state(params: dict, module) -> dict:
    """The torch state_dict of CharLSTM holding a flax CharLSTM's parameters.

    flax's (Optimized)LSTMCell keeps per gate g in (i, f, g, o) an input kernel `i{g}`
    [in, H] (no bias) and a recurrent kernel and bias `h{g}` [H, H], [H]; torch.nn.LSTM
    stacks the gates in the same order along rows: weight_ih_l{k} [4H, in],
    weight_hh_l{k} [4H, H], bias_hh_l{k} [4H] (bias_ih_l{k}: zeros, see CharLSTM).
    """
    import torch

    def t(a):
        return torch.tensor(np.ascontiguousarray(np.asarray(a)))

    state = {"embedding.weight": t(params["embedding"]["embedding"])}
    k = 0
    while f"lstm_{k}" in params:
        cell = params[f"lstm_{k}"]
        ih = np.concatenate([np.asarray(cell[f"i{g}"]["kernel"]) for g in GATES], axis=1)
        hh = np.concatenate([np.asarray(cell[f"h{g}"]["kernel"]) for g in GATES], axis=1)
        b = np.concatenate([np.asarray(cell[f"h{g}"]["bias"]) for g in GATES])
        state[f"lstm.weight_ih_l{k}"] = t(ih.T)
        state[f"lstm.weight_hh_l{k}"] = t(hh.T)
        state[f"lstm.bias_ih_l{k}"] = torch.zeros(len(b))
        state[f"lstm.bias_hh_l{k}"] = t(b)
        k += 1
    if k != module.lstm.num_layers:
        raise ValueError(f"{k} flax LSTM layers for {module.lstm.num_layers} torch layers")
    state["head.weight"] = t(np.asarray(params["head"]["kernel"]).T)
    state["head.bias"] = t(params["head"]["bias"])
    return state


def flax_to_torch_state(params: dict, module) -> dict:
    """The torch state_dict holding a flax CNN / MLP's parameters (module order =
    flax layer order; conv kernels HWIO -> OIHW, dense kernels transposed; the
    char LSTM: flax_lstm_to_torch_state)."""
    import torch

    if "embedding" in params:
        return flax_lstm_to_torch_state(params, module)

    layers = [v for _, v in sorted(params.items(), key=lambda kv: layer_order(kv[0]))]
    targets = [m for m in module.modules() if isinstance(m, torch.nn.Conv2d | torch.nn.Linear)]
    if len(layers) != len(targets):
        raise ValueError(f"{len(layers)} flax layers for {len(targets)} torch layers")
    state = {}
    names = {id(m): n for n, m in module.named_modules()}
    for leaf, m in zip(layers, targets):
        k = np.asarray(leaf["kernel"])
        k = k.transpose(3, 2, 0, 1) if k.ndim == 4 else k.T
        state[names[id(m)] + ".weight"] = torch.tensor(np.ascontiguousarray(k))
        if "bias" in leaf:
            state[names[id(m)] + ".bias"] = torch.tensor(np.asarray(leaf["bias"]))
    return state


def torch_inputs(x: np.ndarray):
    """A client's inputs as torch wants them: NHWC -> NCHW images, int64 token ids."""
    import torch

    if np.issubdtype(x.dtype, np.integer):
        return torch.from_numpy(x.astype(np.int64))
    return torch.from_numpy(x.transpose(0, 3, 1, 2).copy() if x.ndim == 4 else x)


def torch_loss(spec: dict):
    """The case's loss in torch: F.cross_entropy, or pfljax's "token_cross_entropy"
    (each sequence's mean over its non-padding tokens, then the mean over the batch;
    not F.cross_entropy(ignore_index=0), which weighs sequences by their token counts)."""
    import torch.nn.functional as F

    if spec.get("loss", "cross_entropy") == "cross_entropy":
        return F.cross_entropy
    if spec["loss"] != "token_cross_entropy":
        raise ValueError(f"no torch loss {spec['loss']!r}")

    def token_cross_entropy(logits, y):  # [B, T, V], [B, T]
        ce = F.cross_entropy(logits.transpose(1, 2), y, reduction="none")
        mask = (y != PAD_ID).to(ce.dtype)
        return ((ce * mask).sum(1) / mask.sum(1).clamp(min=1.0)).mean()

    return token_cross_entropy


def torch_loaders(xs, ys, batch: int, seed: int = 0):
    """One DataLoader per client (NHWC numpy -> NCHW tensors), shuffled each epoch."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(seed)
    dev = torch_device()
    loaders = []
    for x, y in zip(xs, ys):
        xt = torch_inputs(x).to(dev)
        yt = torch.from_numpy(y.astype(np.int64)).to(dev)
        loaders.append(DataLoader(TensorDataset(xt, yt), batch_size=batch, shuffle=True, generator=g))
    return loaders


def torch_round(model, global_state: dict, loaders, sizes, epochs: int, lr: float, loss_fn=None) -> dict:
    """One FedAvg round the FL-bench / PFLlib way; returns the new global state_dict."""
    import torch
    import torch.nn.functional as F

    loss_fn = loss_fn or F.cross_entropy

    new_states = []
    for loader in loaders:
        model.load_state_dict(global_state)
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        for _ in range(epochs):
            for xb, yb in loader:
                opt.zero_grad()
                loss_fn(model(xb), yb).backward()
                opt.step()
        new_states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    w = torch.tensor(sizes, dtype=torch.float32, device=torch_device())
    w = w / w.sum()
    out = {}
    for k, v in global_state.items():
        if v.is_floating_point():
            out[k] = sum(wc * s[k] for wc, s in zip(w, new_states))
        else:
            out[k] = new_states[-1][k]
    _sync()
    return out


# ---------------------------------------------------------------- one case


def client_inputs(spec: dict, sizes, seed: int = 0) -> tuple[list, list]:
    """Random inputs and targets of each client: normal features and class labels, or
    for the char LSTM windows of ids 1..V-1 with next-id targets (x = w[:-1], y = w[1:],
    as pfljax.data.shakespeare.tff_windows cuts them), one window in eight a snippet's
    last, ending in padding (PAD_ID) from a random position."""
    rng = np.random.default_rng(seed)
    if spec["model"] != "char_lstm":
        xs = [rng.normal(size=(n, *spec["input_shape"])).astype(np.float32) for n in sizes]
        ys = [rng.integers(0, spec["classes"], n).astype(np.int32) for n in sizes]
        return xs, ys
    t = spec["input_shape"][0]
    xs, ys = [], []
    for n in sizes:
        w = rng.integers(1, spec["classes"], (n, t + 1)).astype(np.int32)
        ends = np.where(rng.random(n) < 1 / 8, rng.integers(2, t + 1, n), t + 1)
        w[np.arange(t + 1)[None, :] >= ends[:, None]] = PAD_ID
        xs.append(w[:, :-1])
        ys.append(w[:, 1:])
    return xs, ys


def client_sizes(
    num_clients: int, rows: int, split: str, classes: int, seed: int = 0, alpha: float = 0.1
) -> list[int]:
    if split == "equal":
        return [rows] * num_clients
    labels = np.random.default_rng(seed).integers(0, classes, num_clients * rows)
    parts = dirichlet(labels, num_clients, seed, alpha=alpha, min_size=1)
    return [len(p) for p in parts]


def pfljax_round(model, local: LocalTraining, data: ClientData, num_clients: int, devices: int):
    """(jitted FedAvg round, initial state, data), the clients sharded over the first
    `devices` devices as the binaries shard them when `devices` > 1."""
    if devices == 1:
        alg = fedavg.build(model, local)
        return jax.jit(alg.round), alg.init(jax.random.key(0), None, num_clients), data
    mesh = client_mesh(devices)
    alg = fedavg.build(model, local, client_map=ShardedMap(mesh))
    run = shard_algorithm(alg, mesh, num_clients)
    state = run.place_state(alg.init(jax.random.key(0), None, num_clients))
    return jax.jit(run.round), state, run.place_data(data)


class Options(NamedTuple):
    """run_case's settings (the binary's flags of the same names; rows 0: the case's own)."""

    rows: int = 0
    epochs: int = 1
    repeats: int = 3
    lr: float = 0.01
    alpha: float = 0.1
    conv_impl: str = "auto"  # pfljax's convolution (pfljax.models.conv.IMPLS) in the conv cases
    lstm_impl: str = "auto"  # how the char LSTM runs (pfljax.models.lstm.IMPLS) in the lstm case
    torch_threads: int = 0  # torch.set_num_threads in the torch side's process (0: torch's default)


def flag_options() -> Options:
    """Options from the binary's flags."""
    return Options(
        FLAGS.rows, FLAGS.epochs, FLAGS.repeats, FLAGS.lr, FLAGS.alpha, torch_threads=FLAGS.torch_threads
    )


def run_case(
    name: str, num_clients: int, split: str, peaks: dict, opts: Options | None = None, devices: int = 1
) -> dict:
    """The JSON row of one case: pfljax (opts.conv_impl, or opts.lstm_impl) against the torch loop."""
    opts = opts or flag_options()
    impl = opts.lstm_impl if CASES[name]["model"] == "char_lstm" else opts.conv_impl
    return run_impls(name, num_clients, split, peaks, opts, (impl,), devices)[0]


class TorchSide:
    """The torch loop of a case in a process of its own (spawned; `opts.torch_threads`, the
    parent's torch_device()), timing one round per call: `with TorchSide(...) as torch_once:
    seconds = torch_once()`; `torch_once.state()`: its global state_dict (numpy) so far.
    Its own process because oneDNN calls made inside XLA programs slow later torch rounds in
    the same process (bench CNN, 10 clients: torch's round 0.40 s after pfljax rounds with
    `conv_impl=im2col_nn`, 0.69 s after rounds with `onednn`)."""

    def __init__(self, name: str, sizes: list[int], opts: Options):
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        device = str(torch_device())
        self.process = context.Process(target=_torch_side, args=(child, name, sizes, opts, device))

    def __enter__(self):
        self.process.start()
        return self

    def __call__(self) -> float:
        self.conn.send("round")
        return self.conn.recv()

    def state(self) -> dict:
        self.conn.send("state")
        return self.conn.recv()

    def __exit__(self, *exc):
        if self.process.is_alive():  # a process that failed has printed its traceback already
            self.conn.send("stop")
        self.process.join()


def _torch_side(conn, name: str, sizes: list[int], opts: Options, device: str) -> None:
    """TorchSide's process: the case's torch model (seed 0), data and loaders, then per
    request one timed round or the state, until told to stop. JAX stays unused here (its
    GPU backend would take the device's memory)."""
    import torch

    global _DEVICE
    _DEVICE = device
    if opts.torch_threads:
        torch.set_num_threads(opts.torch_threads)
    spec = CASES[name]
    xs, ys = client_inputs(spec, sizes)
    torch.manual_seed(0)
    model = torch_model(name, spec).to(torch_device())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    loaders = torch_loaders(xs, ys, spec["batch"])
    loss_fn = torch_loss(spec)
    while (request := conn.recv()) != "stop":
        if request == "state":
            conn.send({k: v.cpu().numpy() for k, v in state.items()})
            continue
        t0 = time.perf_counter()
        state = torch_round(model, state, loaders, sizes, opts.epochs, opts.lr, loss_fn)
        conn.send(time.perf_counter() - t0)


def run_impls(
    name: str, num_clients: int, split: str, peaks: dict, opts: Options, impls: tuple, devices: int = 1
) -> list[dict]:
    """A row per pfljax convolution in `impls` (conv cases; the lstm case: per char-LSTM impl;
    others: one row), every repeat timing each impl's round then the torch round (TorchSide),
    so that all rows share one torch timing and one stretch of the machine's load: before/after
    figures from one run."""
    spec = CASES[name]
    rows = opts.rows or spec["rows"]
    sizes = client_sizes(num_clients, rows, split, spec["classes"], alpha=opts.alpha)
    xs, ys = client_inputs(spec, sizes)
    is_conv = spec["model"] in ("cnn", "resnet9")
    is_lstm = spec["model"] == "char_lstm"
    loss = spec.get("loss", "cross_entropy")
    local = LocalTraining(optax.sgd(opts.lr), batch_size=spec["batch"], epochs=opts.epochs, loss=loss)
    arrays = pad_clients(xs, ys)
    sides = []
    for impl in impls if is_conv or is_lstm else (opts.conv_impl,):
        conv = {"conv_impl": impl} if is_conv else {"impl": impl} if is_lstm else {}
        model = build_model(spec["model"], spec["input_shape"], spec["classes"], **spec["kwargs"], **conv)
        rnd, state, data = pfljax_round(model, local, ClientData(arrays, arrays), num_clients, devices)
        sides.append({"conv": conv, "model": model, "round": rnd, "state": state, "data": data, "times": []})

    def jax_once(side, i):
        t0 = time.perf_counter()
        side["state"], m = side["round"](side["state"], side["data"], jax.random.key(i))
        jax.block_until_ready((side["state"], m))
        return time.perf_counter() - t0

    with TorchSide(name, sizes, opts) as torch_once:
        for side in sides:
            side["compile_s"] = jax_once(side, 0)
        torch_once()
        tt = []
        for r in range(opts.repeats):
            for side in sides:
                side["times"].append(jax_once(side, r + 1))
            tt.append(torch_once())
    return [_row(name, spec, side, tt, sizes, split, opts, peaks, devices, local, arrays) for side in sides]


def _row(name, spec, side, tt, sizes, split, opts, peaks, devices, local, arrays) -> dict:
    jt, conv = side["times"], side["conv"]
    samples = opts.epochs * sum(sizes)
    fwd = forward_flops(name, spec)
    round_flops = 3.0 * fwd * samples
    jm, tm = statistics.median(jt), statistics.median(tt)
    return {
        "case": name,
        "conv_impl": conv.get("conv_impl"),
        "conv_resolved": resolve_impl(conv["conv_impl"]) if "conv_impl" in conv else None,
        **(
            {"lstm_impl": conv["impl"], "lstm_resolved": resolve_lstm_impl(conv["impl"])}
            if "impl" in conv
            else {}
        ),
        "devices": devices,
        "clients": len(sizes),
        "split": split if split == "equal" else f"dirichlet{opts.alpha}",
        "rows_min_max": [min(sizes), max(sizes)],
        "batch": spec["batch"],
        "epochs": opts.epochs,
        "samples": samples,
        "pfljax_s": [round(jm, 4), round(min(jt), 4), round(max(jt), 4)],
        "torch_s": [round(tm, 4), round(min(tt), 4), round(max(tt), 4)],
        "pfljax_first_round_s": round(side["compile_s"], 2),
        "pfljax_samples_per_s": round(samples / jm, 1),
        "torch_samples_per_s": round(samples / tm, 1),
        "torch_over_pfljax": round(tm / jm, 2),
        "fwd_mflop_per_sample": round(fwd / 1e6, 3),
        "train_mflop_per_sample": round(3 * fwd / 1e6, 3),
        "xla_step_mflop_per_sample": round(xla_step_flops_per_sample(side["model"], local, arrays) / 1e6, 3),
        "round_gflop": round(round_flops / 1e9, 2),
        "pfljax_gflops": round(round_flops / jm / 1e9, 2),
        "torch_gflops": round(round_flops / tm / 1e9, 2),
        "pfljax_of_peak": round(round_flops / jm / 1e9 / peaks["jax"], 3),
        "torch_of_peak": round(round_flops / tm / 1e9 / peaks["torch"], 3),
        "loadavg": [round(v, 2) for v in os.getloadavg()],
    }


def main(argv):
    del argv
    if missing_package("torch"):
        fail("missing package torch (the benchmark's other side): pip install -e '.[bench]'")
    import torch

    if FLAGS.torch_threads < 0:
        raise app.UsageError(f"--torch_threads must be >= 0, got {FLAGS.torch_threads}")
    if FLAGS.torch_threads:
        torch.set_num_threads(FLAGS.torch_threads)
    devices = [int(d) for d in FLAGS.devices if d.isdigit() and int(d) >= 1]
    if len(devices) != len(FLAGS.devices):
        raise app.UsageError(f"--devices must be a list of integers >= 1, got {','.join(FLAGS.devices)}")
    use_cpu_devices(max(devices))  # before JAX runs anything; only the CPU backend's count
    if max(devices) > jax.device_count():
        raise app.UsageError(f"--devices must be at most {jax.device_count()} here, got {max(devices)}")
    for name in FLAGS.cases:
        if name not in CASES:
            raise app.UsageError(f"--cases must be among {sorted(CASES)}, got {name!r}")
    peaks = {"jax": jax_matmul_peak(), "torch": torch_matmul_peak_apart(FLAGS.torch_threads)}
    print(
        json.dumps(
            {
                "machine": {
                    "backend": jax.default_backend(),
                    "devices": str(jax.devices()[0]),
                    "device_count": jax.device_count(),
                    "cpu_count": os.cpu_count(),
                    "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads(),
                    "torch_device": str(torch_device()),
                    "jax": jax.__version__,
                    "jax_matmul_peak_gflops": round(peaks["jax"], 1),
                    "torch_matmul_peak_gflops": round(peaks["torch"], 1),
                    "loadavg": [round(v, 2) for v in os.getloadavg()],
                }
            }
        ),
        flush=True,
    )
    splits = ["equal", "dirichlet"] if FLAGS.split == "both" else [FLAGS.split]
    opts = flag_options()
    for name in FLAGS.cases:
        for split in splits:
            for c in FLAGS.clients:
                for d in devices:
                    lstm = CASES[name]["model"] == "char_lstm"
                    impls = tuple(FLAGS.lstm_impl if lstm else FLAGS.conv_impl)
                    rows = run_impls(name, int(c), split, peaks, opts, impls, devices=d)
                    for row in rows:
                        print(json.dumps(row), flush=True)


def define_flags():
    """The binary's flags, defined only when it runs (importing the module, as the
    test does, must not clash with other experiments' flags such as --lr)."""
    flags.DEFINE_list("cases", ["cnn", "mlp"], "cases: cnn, mlp, fedavgcnn, refcnn, resnet9, lstm")
    flags.DEFINE_list("clients", ["10", "100"], "client counts")
    flags.DEFINE_enum("split", "equal", ["equal", "dirichlet", "both"], "client sizes")
    flags.DEFINE_integer("rows", 0, "rows per client (0: the case's own); dirichlet: the mean")
    flags.DEFINE_integer("epochs", 1, "local epochs E")
    flags.DEFINE_integer("repeats", 3, "timed repeats of each side (interleaved)")
    flags.DEFINE_float("lr", 0.01, "SGD learning rate")
    flags.DEFINE_float("alpha", 0.1, "Dirichlet concentration of --split=dirichlet")
    flags.DEFINE_list(
        "conv_impl", ["auto"], f"pfljax's convolution in the conv cases, a row per value: {', '.join(IMPLS)}"
    )
    flags.register_validator(
        "conv_impl", lambda impls: set(impls) <= set(IMPLS), f"--conv_impl must be among {', '.join(IMPLS)}"
    )
    flags.register_validator("conv_impl", lambda impls: all(map(runs_here, impls)), ONEDNN_MISSING)
    flags.DEFINE_list(
        "lstm_impl",
        ["auto"],
        f"the char LSTM's way of running in the lstm case, a row per value: {', '.join(LSTM_IMPLS)}",
    )
    flags.register_validator(
        "lstm_impl",
        lambda impls: set(impls) <= set(LSTM_IMPLS),
        f"--lstm_impl must be among {', '.join(LSTM_IMPLS)}",
    )
    flags.register_validator(
        "lstm_impl",
        lambda impls: "onednn" not in impls or runs_here("onednn"),
        "--lstm_impl 'onednn': oneDNN cannot be built here (needs g++ and libdnnl-dev; "
        "pfljax.models.onednn.unavailable_reason() says why)",
    )
    flags.DEFINE_list(
        "devices", ["1"], "pfljax: shard the clients over D devices, a row per D (CPU: host devices forced)"
    )
    flags.DEFINE_integer(
        "torch_threads",
        0,
        "torch.set_num_threads (0: torch's default, one per core); on a shared, loaded CPU 1 avoids "
        "OpenMP threads waiting on descheduled peers (measured here: 100 ms vs 1 ms per MLP step)",
    )


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
