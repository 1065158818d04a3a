import chex
import jax
import jax.numpy as jnp
import pytest

from pfljax.models import build_model


@pytest.mark.parametrize(
    "name,shape", [("mlp", (100,)), ("cnn", (28, 28, 1)), ("cnn_bn", (28, 28, 1)), ("cnn", (32, 32, 3))]
)
def test_shapes_and_layer_names(name, shape):
    model = build_model(name, shape, 7)
    v = model.init(jax.random.key(0))
    out, upd = model.apply(v, jnp.ones((5, *shape)), train=True)
    chex.assert_shape(out, (5, 7))
    assert "head" in v["params"]
    if name == "cnn_bn":
        assert set(upd) == {"batch_stats"} and "bn_0" in v["batch_stats"]
    else:
        assert upd == {}


def test_unknown_model():
    with pytest.raises(ValueError, match="model must be one of"):
        build_model("resnet1000", (3,), 2)


def test_cnn_with_fedavgcnn_sizes_has_pfllib_fedavgcnn_parameter_count():
    # PFLlib's FedAvgCNN(in_features=1, num_classes=10, dim=1024) on 28x28x1:
    # conv1 5x5, 1 -> 32:    5*5*1*32 + 32 =     832   (28 -> 24, pool -> 12)
    # conv2 5x5, 32 -> 64:   5*5*32*64 + 64 = 51,264   (12 -> 8, pool -> 4)
    # fc1 4*4*64 = 1024 -> 512: 1024*512 + 512 = 524,800
    # fc 512 -> 10:          512*10 + 10 =    5,130
    # total 832 + 51,264 + 524,800 + 5,130 = 582,026
    from pfljax.experiment.configs import pfllib_fmnist  # pylint: disable=import-outside-toplevel

    kwargs = pfllib_fmnist.get_config().model_kwargs.to_dict()
    model = build_model("cnn", (28, 28, 1), 10, **kwargs)
    v = model.init(jax.random.key(0))
    shapes = {k: {n: p.shape for n, p in layer.items()} for k, layer in v["params"].items()}
    assert shapes == {
        "conv_0": {"kernel": (5, 5, 1, 32), "bias": (32,)},
        "conv_1": {"kernel": (5, 5, 32, 64), "bias": (64,)},
        "dense_0": {"kernel": (1024, 512), "bias": (512,)},
        "head": {"kernel": (512, 10), "bias": (10,)},
    }
    assert sum(p.size for p in jax.tree_util.tree_leaves(v)) == 582_026


def test_cnn_torch_init_scheme_is_torch_default_uniform_and_flax_is_unchanged():
    # torch.nn.Conv2d / Linear reset_parameters: kaiming_uniform_(a=sqrt(5)) on the weight and
    # U(-1/sqrt(fan_in), 1/sqrt(fan_in)) on the bias, i.e. both U(+-1/sqrt(fan_in)).
    kw = {"channels": (32, 64), "dense": (512,), "kernel_size": 5, "padding": "VALID"}
    key = jax.random.key(0)
    torch_v = build_model("cnn", (28, 28, 1), 10, init_scheme="torch", **kw).init(key)["params"]
    fan_in = {"conv_0": 25, "conv_1": 800, "dense_0": 1024, "head": 512}
    for name, n in fan_in.items():
        bound = n**-0.5
        for leaf in ("kernel", "bias"):
            x = torch_v[name][leaf]
            assert float(jnp.max(jnp.abs(x))) <= bound
            if x.size >= 500:  # U(-b, b): std b / sqrt(3)
                assert abs(float(jnp.std(x)) - bound / 3**0.5) < 0.1 * bound
    flax_v = build_model("cnn", (28, 28, 1), 10, init_scheme="flax", **kw).init(key)["params"]
    plain_v = build_model("cnn", (28, 28, 1), 10, **kw).init(key)["params"]
    chex.assert_trees_all_equal(flax_v, plain_v)
    assert float(jnp.max(jnp.abs(flax_v["head"]["bias"]))) == 0.0
    assert abs(float(jnp.std(flax_v["dense_0"]["kernel"])) - 1024**-0.5) < 0.1 * 1024**-0.5
    with pytest.raises(ValueError, match="init must be one of"):
        build_model("cnn", (28, 28, 1), 10, init_scheme="jax", **kw).init(key)


def test_from_flax_takes_a_module_without_a_train_flag_and_one_with_batch_norm():
    import flax.linen as nn  # noqa: PLC0415
    import optax  # noqa: PLC0415

    from pfljax import LocalTraining, fedavg  # noqa: PLC0415
    from pfljax.data import build_federated_data  # noqa: PLC0415
    from pfljax.models import from_flax  # noqa: PLC0415

    class Plain(nn.Module):  # an ordinary linen module: __call__(x) only
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(nn.relu(nn.Dense(8)(x.reshape(x.shape[0], -1))))

    class Normed(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            x = nn.BatchNorm(use_running_average=not train)(x.reshape(x.shape[0], -1))
            return nn.Dense(3)(x)

    x = jax.random.normal(jax.random.key(0), (4, 5))
    plain = from_flax(Plain(), (5,), 3)
    variables = plain.init(jax.random.key(1))
    out, updates = plain.apply(variables, x, train=True)
    chex.assert_trees_all_close(out, Plain().apply(variables, x))
    assert updates == {}
    normed = from_flax(Normed(), (5,), 3)
    variables = normed.init(jax.random.key(1))
    out, updates = normed.apply(variables, x, train=True)
    assert "batch_stats" in updates
    chex.assert_trees_all_close(out, Normed().apply(variables, x, train=True, mutable=["batch_stats"])[0])
    # A FedAvg round over the plain module trains it.
    fd = build_federated_data(
        "simulation", 4, seed=0, source_kwargs={"samples_per_client": 20, "d": 5, "m": 3}
    )
    model = from_flax(Plain(), fd.input_shape, fd.num_classes)
    alg = fedavg.build(model, LocalTraining(optax.sgd(0.1), batch_size=8, epochs=1))
    state = alg.init(jax.random.key(0), None, 4)
    new, metrics = jax.jit(alg.round)(state, fd.data, jax.random.key(1))
    assert int(new.round) == 1 and bool(jnp.isfinite(metrics["train_loss"]))
