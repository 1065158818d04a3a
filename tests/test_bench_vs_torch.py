"""The PyTorch reference round of experiments/bench/bench_vs_torch.py computes pfljax's update.

Same initial weights (flax -> torch), the same batches (pfljax's schedule,
`step_batch`, fed to torch), plain SGD: the parameters after one client's local
epoch agree to float32 tolerance. A whole round (the bench's own `torch_round`,
DataLoaders and host averaging against `fedavg.build(...).round`) agrees too when
every epoch is one full batch, where the shuffled order cannot matter. For the char
LSTM this proves the gate layout (flax's i, f, g, o kernels and one bias -> torch's
weight_ih / weight_hh / bias_hh, bias_ih frozen at 0) and the masked per-token loss.
Skipped where torch is not installed.
"""

import jax
import numpy as np
import optax
import pytest

torch = pytest.importorskip("torch")

from experiments.bench.bench_vs_torch import (  # noqa: E402
    CASES,
    Options,
    TorchSide,
    client_inputs,
    flax_to_torch_state,
    forward_flops,
    torch_device,
    torch_inputs,
    torch_loaders,
    torch_loss,
    torch_model,
    torch_round,
)
from pfljax.algorithms import fedavg  # noqa: E402
from pfljax.core.local import LocalTraining, make_local_train, step_batch  # noqa: E402
from pfljax.core.types import ClientArrays, ClientData  # noqa: E402
from pfljax.data.federated import pad_clients  # noqa: E402
from pfljax.models import build_model  # noqa: E402

TINY = {
    "cnn": dict(model="cnn", input_shape=(20, 20, 1), classes=3, kwargs={"channels": (2, 3), "dense": (8,)}),
    "mlp": dict(model="mlp", input_shape=(6,), classes=3, kwargs={"hidden": (5,)}),
    "refcnn": dict(
        model="cnn",
        input_shape=(9, 9, 1),
        classes=3,
        kwargs={"channels": (2, 3), "dense": (4,), "padding": "SAME"},
    ),
    # The bench's "lstm" shrunk: windows of 7, vocabulary 11, embedding 3, two layers of 5.
    "lstm": dict(
        model="char_lstm",
        input_shape=(7,),
        classes=11,
        kwargs={"embed": 3, "hidden": (5, 5), "last_only": False},
        loss="token_cross_entropy",
    ),
}


def tiny_model(spec):
    return build_model(spec["model"], spec["input_shape"], spec["classes"], **spec["kwargs"])


@pytest.fixture
def one_torch_thread():
    # OpenMP threads waiting on descheduled peers make tiny torch steps ~100x slower on a loaded CPU.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", ["cnn", "mlp", "refcnn", "lstm"])
def test_torch_local_epoch_equals_pfljax(name, one_torch_thread):
    spec = TINY[name]
    n, batch, lr = 10, 4, 0.1  # 3 steps, the last a partial batch of 2 rows
    (x,), (y,) = client_inputs(spec, [n])
    if name == "lstm":  # padded windows of several lengths, so that the mask is exercised
        y[:3, 4:], y[3, 1:] = 0, 0
        assert (y == 0).any(axis=1).sum() >= 4
    model = tiny_model(spec)
    variables = model.init(jax.random.key(1))
    local = LocalTraining(optax.sgd(lr), batch_size=batch, epochs=1, loss=spec.get("loss", "cross_entropy"))
    data = ClientArrays(x, y, np.int32(n))
    key = jax.random.key(2)
    trained = jax.jit(make_local_train(model.apply, local))(variables, data, key).params["params"]

    net = torch_model(name, spec)
    net.load_state_dict(flax_to_torch_state(variables["params"], net))
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    loss_fn = torch_loss(spec)
    xt = torch_inputs(x)
    yt = torch.from_numpy(y.astype(np.int64))
    seen = []
    for s in range(3):
        rows, weights, active = step_batch(local, key, s, np.int32(n), n)
        assert bool(active)
        idx = torch.from_numpy(np.asarray(rows)[np.asarray(weights) > 0].astype(np.int64))
        seen.extend(idx.tolist())
        opt.zero_grad()
        loss_fn(net(xt[idx]), yt[idx]).backward()
        opt.step()
    assert sorted(seen) == list(range(n))  # one epoch: every row once

    want = flax_to_torch_state(trained, net)
    got = net.state_dict()
    assert set(want) == set(got)
    moved = 0.0
    start = flax_to_torch_state(variables["params"], net)
    for k in want:
        np.testing.assert_allclose(got[k].numpy(), want[k].numpy(), rtol=1e-5, atol=1e-6, err_msg=k)
        moved = max(moved, float((want[k] - start[k]).abs().max()))
    assert moved > 1e-3  # the epoch did move the weights


@pytest.mark.parametrize("name", ["mlp", "lstm"])
def test_torch_round_equals_pfljax_round(name, one_torch_thread):
    # Three clients of 3, 5 and 2 rows, batch 5 and two epochs: each epoch is one batch of
    # all of a client's rows, so torch's shuffled DataLoader takes pfljax's steps exactly.
    spec, sizes, lr, epochs = TINY[name], [3, 5, 2], 0.5, 2
    xs, ys = client_inputs(spec, sizes, seed=3)
    model = tiny_model(spec)
    local = LocalTraining(
        optax.sgd(lr), batch_size=max(sizes), epochs=epochs, loss=spec.get("loss", "cross_entropy")
    )
    alg = fedavg.build(model, local)
    state = alg.init(jax.random.key(1), None, len(sizes))
    arrays = pad_clients(xs, ys)
    new, _ = jax.jit(alg.round)(state, ClientData(arrays, arrays), jax.random.key(2))

    dev = torch_device()  # the bench's: a GPU only where both torch and jax have one
    net = torch_model(name, spec).to(dev)
    start = flax_to_torch_state(state.global_params["params"], net)
    loaders = torch_loaders(xs, ys, max(sizes))
    on_dev = {k: v.to(dev) for k, v in start.items()}
    got = torch_round(net, on_dev, loaders, sizes, epochs, lr, torch_loss(spec))
    want = flax_to_torch_state(new.global_params["params"], net)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(got[k].cpu().numpy(), want[k].numpy(), rtol=1e-5, atol=1e-6, err_msg=k)
    moved = max(float((want[k] - start[k]).abs().max()) for k in want)
    assert moved > 1e-3


def test_lstm_gate_layout_forward(one_torch_thread):
    # Same outputs before any training, at every position, with a bias in every gate.
    spec = TINY["lstm"]
    model = tiny_model(spec)
    variables = model.init(jax.random.key(4))
    params = jax.tree.map(np.asarray, variables["params"])
    rng = np.random.default_rng(5)
    for k in ("lstm_0", "lstm_1"):
        for g in "ifgo":
            params[k][f"h{g}"]["bias"] = rng.normal(size=5).astype(np.float32)
    (x,), _ = client_inputs(spec, [6])
    out, _ = model.apply({"params": params}, x)
    net = torch_model("lstm", spec)
    net.load_state_dict(flax_to_torch_state(params, net))
    with torch.no_grad():
        got = net(torch_inputs(x)).numpy()
    np.testing.assert_allclose(got, np.asarray(out), rtol=1e-5, atol=1e-6)
    frozen = [n for n, p in net.named_parameters() if not p.requires_grad]
    assert frozen == ["lstm.bias_ih_l0", "lstm.bias_ih_l1"]


def test_forward_flops_by_hand():
    # The bench CNN on 28x28x1: conv 24*24*16*25 + conv 8*8*32*400 + dense 512*100 + head 100*10 MACs.
    cnn = dict(model="cnn", input_shape=(28, 28, 1), classes=10, kwargs={})
    assert forward_flops("cnn", cnn) == 2 * (230400 + 819200 + 51200 + 1000)
    mlp = dict(model="mlp", input_shape=(100,), classes=2, kwargs={"hidden": (200,)})
    assert forward_flops("mlp", mlp) == 2 * (100 * 200 + 200 * 2)
    # The CNN of the reference torch loop ('SAME' 5x5, dense 128): about 6 MFLOP forward.
    ref = dict(model="cnn", input_shape=(28, 28, 1), classes=10, kwargs={"padding": "SAME", "dense": (128,)})
    assert forward_flops("refcnn", ref) == 2 * (313600 + 2508800 + 200704 + 1280)
    # The char LSTM, per position: 4 x 256 x (8 + 256) + 4 x 256 x (256 + 256) + 256 x 80, x 80 positions.
    lstm = dict(
        model="char_lstm",
        input_shape=(80,),
        classes=80,
        kwargs={"embed": 8, "hidden": (256, 256), "last_only": False},
    )
    assert forward_flops("lstm", lstm) == 2 * 80 * (270336 + 524288 + 20480)


def test_torch_side_in_its_own_process_runs_the_in_process_rounds(one_torch_thread):
    """TorchSide's spawned process (the bench's torch timings) trains what torch_round does
    here: same seed, data and shuffles, two rounds, states equal."""
    sizes, opts = [3, 5], Options(lr=0.05, torch_threads=1)
    with TorchSide("mlp", sizes, opts) as torch_once:
        seconds = [torch_once(), torch_once()]
        theirs = torch_once.state()
    assert all(s > 0 for s in seconds)
    assert torch_once.process.exitcode == 0
    spec = CASES["mlp"]
    xs, ys = client_inputs(spec, sizes)
    torch.manual_seed(0)
    model = torch_model("mlp", spec)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    loaders = torch_loaders(xs, ys, spec["batch"])
    for _ in range(2):
        state = torch_round(model, state, loaders, sizes, opts.epochs, opts.lr, torch_loss(spec))
    assert sorted(theirs) == sorted(state)
    for k, v in state.items():
        np.testing.assert_allclose(theirs[k], v.numpy(), rtol=1e-6, atol=1e-7, err_msg=k)
