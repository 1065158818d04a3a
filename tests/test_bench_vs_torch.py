"""The PyTorch reference round of experiments/bench_vs_torch.py computes pfljax's update.

Same initial weights (flax -> torch), the same batches (pfljax's schedule,
`step_batch`, fed to torch), plain SGD: the parameters after one client's local
epoch agree to float32 tolerance. Skipped where torch is not installed.
"""

import jax
import numpy as np
import optax
import pytest

torch = pytest.importorskip("torch")

from experiments.bench_vs_torch import flax_to_torch_state, forward_flops, torch_model  # noqa: E402
from pfljax.core.local import LocalTraining, make_local_train, step_batch  # noqa: E402
from pfljax.core.types import ClientArrays  # noqa: E402
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
}


@pytest.fixture
def one_torch_thread():
    # OpenMP threads waiting on descheduled peers make tiny torch steps ~100x slower on a loaded CPU.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", ["cnn", "mlp", "refcnn"])
def test_torch_local_epoch_equals_pfljax(name, one_torch_thread):
    spec = TINY[name]
    n, batch, lr = 10, 4, 0.1  # 3 steps, the last a partial batch of 2 rows
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, *spec["input_shape"])).astype(np.float32)
    y = rng.integers(0, spec["classes"], n).astype(np.int32)
    model = build_model(spec["model"], spec["input_shape"], spec["classes"], **spec["kwargs"])
    variables = model.init(jax.random.key(1))
    local = LocalTraining(optax.sgd(lr), batch_size=batch, epochs=1)
    data = ClientArrays(x, y, np.int32(n))
    key = jax.random.key(2)
    trained = jax.jit(make_local_train(model.apply, local))(variables, data, key).params["params"]

    net = torch_model(name, spec)
    net.load_state_dict(flax_to_torch_state(variables["params"], net))
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    xt = torch.from_numpy(x.transpose(0, 3, 1, 2).copy() if x.ndim == 4 else x)
    yt = torch.from_numpy(y.astype(np.int64))
    seen = []
    for s in range(3):
        rows, weights, active = step_batch(local, key, s, np.int32(n), n)
        assert bool(active)
        idx = torch.from_numpy(np.asarray(rows)[np.asarray(weights) > 0].astype(np.int64))
        seen.extend(idx.tolist())
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(xt[idx]), yt[idx]).backward()
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


def test_forward_flops_by_hand():
    # The bench CNN on 28x28x1: conv 24*24*16*25 + conv 8*8*32*400 + dense 512*100 + head 100*10 MACs.
    cnn = dict(model="cnn", input_shape=(28, 28, 1), classes=10, kwargs={})
    assert forward_flops("cnn", cnn) == 2 * (230400 + 819200 + 51200 + 1000)
    mlp = dict(model="mlp", input_shape=(100,), classes=2, kwargs={"hidden": (200,)})
    assert forward_flops("mlp", mlp) == 2 * (100 * 200 + 200 * 2)
    # The CNN of the reference torch loop ('SAME' 5x5, dense 128): about 6 MFLOP forward.
    ref = dict(model="cnn", input_shape=(28, 28, 1), classes=10, kwargs={"padding": "SAME", "dense": (128,)})
    assert forward_flops("refcnn", ref) == 2 * (313600 + 2508800 + 200704 + 1280)
