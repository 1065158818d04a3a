"""experiments/pfllib/oracle.py without PFLlib: a record written in PFLlib's names from pfljax's
own run must compare at float rounding, a changed tensor must not; the rotation trains the
clients it names; bad flags are one line and exit 2."""

import os
import subprocess
import sys

import numpy as np
import pytest

from experiments.pfllib import oracle
from pfljax.core import round as core_round
from pfljax.core import sampling
from pfljax.core.clients import take

TORCH_SHAPES = {  # PFLlib's FedAvgCNN(1, 10, 1024), a plain model's state_dict
    "conv1.0.weight": (32, 1, 5, 5),
    "conv1.0.bias": (32,),
    "conv2.0.weight": (64, 32, 5, 5),
    "conv2.0.bias": (64,),
    "fc1.0.weight": (512, 1024),
    "fc1.0.bias": (512,),
    "fc.weight": (10, 512),
    "fc.bias": (10,),
}


def write_dataset(root, clients=3, train=10, test=20):
    """A PFLlib dataset directory: {train,test}/<i>.npz holding data={"x" [n, 1, 28, 28], "y"}."""
    rng = np.random.default_rng(0)
    for split, n in (("train", train), ("test", test)):
        os.makedirs(root / split)
        for i in range(clients):
            data = {"x": rng.normal(size=(n, 1, 28, 28)).astype(np.float32), "y": rng.integers(0, 10, n)}
            np.savez(root / split / f"{i}.npz", data=data)


def to_torch(variables) -> dict:
    """FedAvgCNN's flax variables in the plain torch names (from_torch_state's inverse)."""
    p = variables["params"]
    conv = lambda k: np.asarray(k).transpose(3, 2, 0, 1)  # noqa: E731  [kh, kw, I, O] -> [O, I, kh, kw]
    fc1 = np.asarray(p["dense_0"]["kernel"])  # rows in (h, w, c) order -> torch's (c, h, w)
    fc1 = fc1.reshape(-1, 64, fc1.shape[1]).transpose(2, 1, 0).reshape(fc1.shape[1], -1)
    out = {"conv1.0.weight": conv(p["conv_0"]["kernel"]), "conv2.0.weight": conv(p["conv_1"]["kernel"])}
    out |= {"fc1.0.weight": fc1, "fc.weight": np.asarray(p["head"]["kernel"]).T}
    names = {"conv1.0": "conv_0", "conv2.0": "conv_1", "fc1.0": "dense_0", "fc": "head"}
    return out | {f"{t}.bias": np.asarray(p[f]["bias"]) for t, f in names.items()}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("oracle") / "Tiny"
    write_dataset(root)
    rng = np.random.default_rng(1)
    rec = {f"init.model.{k}": rng.uniform(-0.05, 0.05, s).astype(np.float32) for k, s in TORCH_SHAPES.items()}
    rec["acc"] = np.zeros(2)  # two rounds
    return root, rec, oracle.load_data(str(root))


def test_the_loaders_invert_the_torch_layout(case):
    _, rec, _ = case
    variables = oracle.whole_model(rec, "init.model")
    back = to_torch(variables)
    for k in TORCH_SHAPES:
        np.testing.assert_array_equal(back[k], rec[f"init.model.{k}"])


def test_a_record_of_its_own_run_compares_at_rounding_and_a_change_shows(case):
    root, rec, data = case
    state, accs = oracle.run("fedamp", rec, data, lr=0.05, epochs=1, options={})
    assert len(accs) == 3 and all(0 <= a <= 1 for a in accs)
    final = dict(rec)
    for c in range(3):
        final |= {f"final.client{c}.{k}": v for k, v in to_torch(take(state.client_params, c)).items()}
    diffs = oracle.compared("fedamp", final, state, data)
    assert set(diffs) == {f"client {c} model" for c in range(3)}
    assert max(diffs.values()) < 1e-6
    final["final.client1.conv2.0.weight"] = final["final.client1.conv2.0.weight"] * 1.01
    diffs = oracle.compared("fedamp", final, state, data)
    np.testing.assert_allclose(diffs["client 1 model"], 0.01 / 1.01, rtol=1e-4)  # relative to PFLlib's side
    assert diffs["client 0 model"] < 1e-6


def test_fedper_reads_the_base_from_the_server_and_the_heads_from_the_clients(case):
    """PFLlib's FedPer: the server's global model is the base alone; each client holds its head."""
    _, rec, data = case
    state, _ = oracle.run("fedper", {**rec, "acc": np.zeros(1)}, data, 0.05, 1, {})
    torch_names = to_torch(state.global_params)
    final = {**rec, **{f"final.model.{k}": v for k, v in torch_names.items() if not k.startswith("fc.")}}
    for c in range(3):
        final[f"final.client{c}.head.weight"] = np.asarray(state.client_params["params/head/kernel"][c]).T
        final[f"final.client{c}.head.bias"] = np.asarray(state.client_params["params/head/bias"][c])
    diffs = oracle.compared("fedper", final, state, data)
    assert set(diffs) == {"base"} | {f"client {c} head" for c in range(3)}
    assert max(diffs.values()) < 1e-6
    heads = np.asarray(state.client_params["params/head/kernel"])
    assert np.abs(heads[0] - heads[1]).max() > 1e-4  # the heads did train apart


def test_rotation_trains_clients_r_to_r_plus_k(case):
    """Round 0 trains clients 0 and 1, round 1 clients 1 and 2 (FedAMP start=own: a client
    that sits out keeps its model); the sampling is put back afterwards."""
    _, rec, data = case
    one = oracle.run("fedamp", {**rec, "acc": np.zeros(1)}, data, 0.05, 1, {}, rotate=2)[0]
    two = oracle.run("fedamp", {**rec, "acc": np.zeros(2)}, data, 0.05, 1, {}, rotate=2)[0]
    init = oracle.whole_model(rec, "init.model")
    same = lambda a, b: np.allclose(a["params"]["conv_1"]["kernel"], b["params"]["conv_1"]["kernel"])  # noqa: E731
    assert [same(take(one.client_params, c), init) for c in range(3)] == [False, False, True]
    assert [same(take(two.client_params, c), take(one.client_params, c)) for c in range(3)] == [
        True,
        False,
        False,
    ]
    assert core_round.sample_clients is sampling.sample_clients


@pytest.mark.parametrize(
    "args, message",
    [
        (["--method=gpfl"], "--record is required"),
        (
            ["--method=gpfl", "--record=/nonexistent.npz", "--data=/"],
            "--record=/nonexistent.npz: no such file",
        ),
        (["--method=gpfl", "--record=x", "--data=/", "--options=[1]"], "--options must be a JSON object"),
        (["--method=gpfx", "--record=x", "--data=/"], "--method=gpfx: value should be one of"),
        (["--method=gpfl", f"--record={__file__}", "--data=/"], "--data=/: not a PFLlib dataset directory"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(args, message):
    run = subprocess.run(
        [sys.executable, "-m", "experiments.pfllib.oracle", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2
    lines = [ln for ln in run.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], run.stderr
