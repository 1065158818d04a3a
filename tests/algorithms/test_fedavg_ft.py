import chex
import jax
import optax
import pytest

from pfljax.algorithms import fedavg, fedavg_ft
from pfljax.core.clients import take
from pfljax.core.evaluate import evaluate_client
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.experiment.config import algorithm_options
from pfljax.models import build_model
from tests.toydata import toy_data

MODEL = build_model("mlp", (6,), 3, hidden=(8,))
SPEC = LocalTraining(optax.sgd(0.1), batch_size=4, epochs=1, steps=None)


def test_training_is_fedavg_and_evaluation_fine_tunes():
    data = toy_data((10, 6, 9))
    plus, base = fedavg_ft.build(MODEL, SPEC, finetune_epochs=2), fedavg.build(MODEL, SPEC)
    sp = plus.init(jax.random.key(0), None, 3)
    sb = base.init(jax.random.key(0), None, 3)
    sp, _ = plus.round(sp, data, jax.random.key(1))
    sb, _ = base.round(sb, data, jax.random.key(1))
    chex.assert_trees_all_close(sp, sb)
    key = jax.random.key(5)
    got = plus.evaluate(sp, data, key)
    tune = make_local_train(MODEL.apply, SPEC._replace(epochs=2))
    for c in range(3):
        tuned = tune(sp.global_params, take(data.train, c), jax.random.fold_in(key, c)).params
        want = evaluate_client(MODEL.apply, tuned, take(data.test, c))
        chex.assert_trees_all_close(got["accuracy"][c], want["accuracy"], rtol=1e-5)
    with pytest.raises(ValueError, match="finetune_epochs"):
        fedavg_ft.build(MODEL, SPEC, finetune_epochs=0)


def test_fine_tuning_options_are_config_fields():
    options = algorithm_options("fedavg_ft")
    for name in ("finetune_epochs", "finetune_steps", "finetune_batch_size", "finetune_lr"):
        assert name in options, name
    data = toy_data((10, 6, 9))
    alg = fedavg_ft.build(MODEL, SPEC, finetune_steps=3, finetune_batch_size=2, finetune_lr=0.3)
    state = alg.init(jax.random.key(0), None, 3)
    key = jax.random.key(2)
    got = alg.evaluate(state, data, key)
    tune = make_local_train(MODEL.apply, LocalTraining(optax.sgd(0.3), batch_size=2, steps=3, epochs=None))
    for c in range(3):
        tuned = tune(state.global_params, take(data.train, c), jax.random.fold_in(key, c)).params
        want = evaluate_client(MODEL.apply, tuned, take(data.test, c))
        chex.assert_trees_all_close(got["loss"][c], want["loss"], rtol=1e-5)
    for name in ("finetune_steps", "finetune_batch_size", "finetune_lr"):
        with pytest.raises(ValueError, match=name):
            fedavg_ft.build(MODEL, SPEC, **{name: -1})
