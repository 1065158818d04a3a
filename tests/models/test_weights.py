"""Starting weights from a file: the flax layout round-trips; a torch state_dict gives the
model torch's forward pass (oracle: a numpy NCHW implementation of torch's Conv2d /
MaxPool2d / flatten / Linear); files that do not fit are refused naming what is wrong."""

import chex
import jax
import numpy as np
import pytest

from pfljax.experiment.config import ConfigError, base_config, prepare
from pfljax.models import build_model
from pfljax.models.weights import load_variables, save_variables
from tests.experiment.tiny import tiny_config


def _torch_conv(x, w, b):
    """torch.nn.functional.conv2d, stride 1, no padding: x [N, C, H, W], w [O, C, kh, kw]."""
    kh, kw = w.shape[2:]
    h, wd = x.shape[2] - kh + 1, x.shape[3] - kw + 1
    out = np.zeros((x.shape[0], w.shape[0], h, wd))
    for i in range(kh):
        for j in range(kw):
            out += np.einsum("nchw,oc->nohw", x[:, :, i : i + h, j : j + wd], w[:, :, i, j])
    return out + b[None, :, None, None]


def _torch_pool(x):
    n, c, h, w = x.shape
    return x[:, :, : h // 2 * 2, : w // 2 * 2].reshape(n, c, h // 2, 2, w // 2, 2).max(axis=(3, 5))


def _torch_forward(state, x_nchw, convs: int):
    """FedAvgCNN-style forward of a torch state_dict: conv-ReLU-pool blocks, torch.flatten, Linear(-ReLU)s."""
    layers = list(dict.fromkeys(k.rpartition(".")[0] for k in state))
    x = x_nchw
    for i, name in enumerate(layers):
        w, b = state[name + ".weight"], state[name + ".bias"]
        if i < convs:
            x = _torch_pool(np.maximum(_torch_conv(x, w, b), 0))
        else:
            x = x.reshape(x.shape[0], -1) @ w.T + b
            x = np.maximum(x, 0) if i < len(layers) - 1 else x
    return x


def _random_state(shapes: dict, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {k: rng.uniform(-0.5, 0.5, s).astype(np.float32) for k, s in shapes.items()}


def test_a_torch_cnn_state_dict_gives_torchs_outputs(tmp_path):
    # 3 input channels and 2x2x6 maps before the first Linear: both flattenings are reordered.
    model = build_model("cnn", (16, 16, 3), 5, channels=(4, 6), dense=(7,), kernel_size=3)
    state = _random_state(
        {
            "conv1.0.weight": (4, 3, 3, 3),
            "conv1.0.bias": (4,),
            "conv2.0.weight": (6, 4, 3, 3),
            "conv2.0.bias": (6,),
            "fc1.0.weight": (7, 24),
            "fc1.0.bias": (7,),
            "fc.weight": (5, 7),
            "fc.bias": (5,),
        }  # fmt: skip
    )
    x = np.random.default_rng(1).normal(size=(3, 16, 16, 3)).astype(np.float32)
    variables = load_variables(_saved(state, tmp_path), model)
    got, _ = model.apply(variables, x)
    want = _torch_forward(state, x.transpose(0, 3, 1, 2).astype(np.float64), convs=2)
    chex.assert_trees_all_close(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_a_torch_mlp_on_images_reads_torchs_chw_flattening(tmp_path):
    model = build_model("mlp", (4, 4, 3), 5, hidden=(6,))
    state = _random_state({"l1.weight": (6, 48), "l1.bias": (6,), "out.weight": (5, 6), "out.bias": (5,)})
    x = np.random.default_rng(2).normal(size=(2, 4, 4, 3)).astype(np.float32)
    got, _ = model.apply(load_variables(_saved(state, tmp_path), model), x)
    want = _torch_forward(state, x.transpose(0, 3, 1, 2).astype(np.float64), convs=0)
    chex.assert_trees_all_close(np.asarray(got), want, rtol=1e-4, atol=1e-5)


def test_the_flax_layout_round_trips_with_batch_stats(tmp_path):
    model = build_model("cnn_bn", (12, 12, 1), 3, channels=(2, 3), dense=(4,), kernel_size=3)
    variables = jax.device_get(model.init(jax.random.key(3)))
    path = str(tmp_path / "v.npz")
    save_variables(path, variables)
    chex.assert_trees_all_equal(load_variables(path, model), variables)


def _saved(state: dict, tmp_path) -> str:
    path = str(tmp_path / "state.npz")
    np.savez(path, **state)
    return path


@pytest.mark.parametrize(
    "state,match",
    [
        ({"a.weight": (6, 48), "a.bias": (6,)}, "1 torch layers"),
        ({"a.weight": (6, 47), "a.bias": (6,), "b.weight": (5, 6), "b.bias": (5,)}, "hidden_0/kernel shape"),
        ({"a.weight": (6, 48), "a.bias": (6,), "b.running_mean": (5,)}, "only Conv2d / Linear"),
        ({"params/hidden_0/kernel": (48, 6)}, "missing"),
        (
            {
                "params/hidden_0/kernel": (48, 7),
                "params/hidden_0/bias": (6,),
                "params/head/kernel": (6, 5),
                "params/head/bias": (5,),
            },
            "hidden_0/kernel has shape",
        ),  # fmt: skip
        ({"params/head/bias": (5,), "fc.weight": (5, 6)}, "mixes flax"),
    ],
)
def test_files_that_do_not_fit_the_model_are_refused(state, match, tmp_path):
    model = build_model("mlp", (4, 4, 3), 5, hidden=(6,))
    with pytest.raises(ValueError, match=match):
        load_variables(_saved(_random_state(state), tmp_path), model)


def test_the_torch_layout_refuses_a_batch_norm_model(tmp_path):
    model = build_model("cnn_bn", (12, 12, 1), 3, channels=(2,), dense=(), kernel_size=3)
    with pytest.raises(ValueError, match="batch_stats"):
        load_variables(
            _saved(_random_state({"c.weight": (2, 1, 3, 3), "h.weight": (3, 50)}), tmp_path), model
        )


def test_every_seed_and_client_starts_from_the_file(tmp_path):
    config = tiny_config(base_config(), "ditto")
    model = prepare(config).model
    variables = jax.tree.map(lambda t: np.full(t.shape, 0.25, t.dtype), model.template())
    path = str(tmp_path / "start.npz")
    save_variables(path, variables)
    config.init_params = path
    prep = prepare(config)
    assert any("starting weights" in n for n in prep.notes)
    for seed in (0, 1):
        state = prep.algorithm.init(jax.random.key(seed), prep.initial_params, 6)
        for leaf in jax.tree.leaves(state.global_params) + jax.tree.leaves(state.client_personal):
            assert np.all(np.asarray(leaf) == 0.25)


def test_a_file_of_another_model_is_a_config_error(tmp_path):
    config = tiny_config(base_config())
    path = str(tmp_path / "other.npz")
    save_variables(path, build_model("mlp", (3,), 2, hidden=(4,)).init(jax.random.key(0)))
    config.init_params = path
    with pytest.raises(ConfigError, match="config.init_params: .*has shape"):
        prepare(config)


def test_a_run_from_the_file_of_its_own_initialisation_is_the_same_run(tmp_path):
    # FedAvg's init draws the model from split(key(seed))[0]: saving that draw and starting from
    # it must give the same metrics, through train_and_evaluate and through the replicas program.
    from pfljax.experiment.sweep import train_replicas  # pylint: disable=import-outside-toplevel
    from pfljax.experiment.train import train_and_evaluate  # pylint: disable=import-outside-toplevel

    config = tiny_config(base_config(), rounds=2)
    model = prepare(config).model
    path = str(tmp_path / "own.npz")
    save_variables(path, jax.device_get(model.init(jax.random.split(jax.random.key(0))[0])))
    plain = train_and_evaluate(config, str(tmp_path / "plain"), progress=False)
    config.init_params = path
    started = train_and_evaluate(config, str(tmp_path / "file"), progress=False)
    assert plain["final_mean_accuracy"] == started["final_mean_accuracy"]
    assert plain["final_mean_loss"] == started["final_mean_loss"]
    (rep,) = train_replicas([config], [str(tmp_path / "rep")], checkpoint_dir=str(tmp_path / "ck"))
    assert rep["final_mean_loss"] == pytest.approx(plain["final_mean_loss"], rel=1e-5)
    # Half those weights: both paths read the file (another start, another loss).
    save_variables(
        path,
        jax.tree.map(lambda v: 0.5 * v, jax.device_get(model.init(jax.random.split(jax.random.key(0))[0]))),
    )
    halved = train_and_evaluate(config, str(tmp_path / "half"), progress=False)
    (rep,) = train_replicas([config], [str(tmp_path / "rep_half")], checkpoint_dir=str(tmp_path / "ck_half"))
    assert abs(halved["final_mean_loss"] - plain["final_mean_loss"]) > 1e-4
    assert rep["final_mean_loss"] == pytest.approx(halved["final_mean_loss"], rel=1e-5)


def test_seed_in_the_path_gives_each_seed_its_own_file_alone_and_as_replicas(tmp_path):
    # Files start_0 / start_1 hold the draws of seeds 1 / 0 (swapped, so that the file, not the
    # seed's own draw, decides): replica r of the "{seed}" program is the single run of seed r
    # from its file, and the two replicas differ.
    from pfljax.experiment.sweep import train_replicas  # pylint: disable=import-outside-toplevel
    from pfljax.experiment.train import train_and_evaluate  # pylint: disable=import-outside-toplevel

    config = tiny_config(base_config(), rounds=2)
    model = prepare(config).model
    for seed, other in ((0, 1), (1, 0)):
        draw = jax.device_get(model.init(jax.random.split(jax.random.key(other))[0]))
        save_variables(str(tmp_path / f"start_{seed}.npz"), draw)
    singles, configs = [], []
    for seed in (0, 1):
        c = tiny_config(base_config(), rounds=2)
        c.seed, c.data_seed, c.init_params = seed, 0, str(tmp_path / f"start_{seed}.npz")
        singles.append(train_and_evaluate(c, str(tmp_path / f"single{seed}"), progress=False))
        c = tiny_config(base_config(), rounds=2)
        c.seed, c.data_seed, c.init_params = seed, 0, str(tmp_path / "start_{seed}.npz")
        configs.append(c)
    assert "each seed its own file (seed 1: " in " ".join(prepare(configs[1]).notes)
    reps = train_replicas(
        configs, [str(tmp_path / f"rep{s}") for s in (0, 1)], checkpoint_dir=str(tmp_path / "ck")
    )
    for rep, single in zip(reps, singles):
        assert rep["final_mean_loss"] == pytest.approx(single["final_mean_loss"], rel=1e-5)
    assert abs(singles[0]["final_mean_loss"] - singles[1]["final_mean_loss"]) > 1e-4
    configs[1].seed = 3
    with pytest.raises(ConfigError, match=r"init_params.*start_3\.npz"):
        prepare(configs[1])
