import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax.core.clients import take
from pfljax.core.local import (
    LocalTraining,
    batch_rows,
    epoch_order,
    make_local_train,
    num_scan_steps,
    own_steps,
)
from pfljax.models import build_model
from tests.toydata import toy_arrays, with_junk_rows


@pytest.mark.parametrize("count,batch", [(10, 4), (3, 8), (16, 4)])
def test_epoch_visits_every_real_row_once(count, batch):
    n_max = 20
    order = epoch_order(jax.random.key(0), 0, jnp.int32(count), n_max, batch)
    per_epoch = -(-count // batch)
    seen = []
    for j in range(per_epoch):
        rows, w = batch_rows(order, j, jnp.int32(count), batch)
        seen += [int(r) for r, wi in zip(rows, w) if wi > 0]
    assert sorted(seen) == list(range(count))


def test_epochs_differ_and_are_seeded():
    a = epoch_order(jax.random.key(0), 0, jnp.int32(30), 30, 4)
    b = epoch_order(jax.random.key(0), 1, jnp.int32(30), 30, 4)
    c = epoch_order(jax.random.key(0), 0, jnp.int32(30), 30, 4)
    assert not np.array_equal(a, b)
    np.testing.assert_array_equal(a, c)


def _setup(steps=None, epochs=None, opt=None, counts=(12, 5)):
    model = build_model("mlp", (6,), 3, hidden=(8,))
    spec = LocalTraining(opt or optax.sgd(0.1), batch_size=4, steps=steps, epochs=epochs)
    return model, spec, toy_arrays(counts)


def test_one_step_equals_hand_written_sgd():
    """One full-batch step equals params - lr * grad of the mean loss, computed by hand."""
    model = build_model("mlp", (6,), 3, hidden=(8,))
    data = toy_arrays([4])
    spec = LocalTraining(optax.sgd(0.5), batch_size=4, steps=1, epochs=None)
    params = model.init(jax.random.key(1))
    got = make_local_train(model.apply, spec)(params, take(data, 0), jax.random.key(2)).params

    def loss(p):
        logits = model.apply({"params": p}, data.x[0], train=False)[0]
        return optax.softmax_cross_entropy_with_integer_labels(logits, data.y[0]).mean()

    g = jax.grad(loss)(params["params"])
    want = jax.tree.map(lambda p, gi: p - 0.5 * gi, params["params"], g)
    chex.assert_trees_all_close(got["params"], want, rtol=1e-5, atol=1e-6)


def test_epochs_mode_takes_per_client_number_of_steps():
    """With E epochs, a client of count n takes E * ceil(n / B) real steps: after
    them, further scan steps are no-ops (momentum does not move params)."""
    model, spec, data = _setup(epochs=2, opt=optax.sgd(0.1, momentum=0.9))
    params = model.init(jax.random.key(0))
    train = jax.jit(make_local_train(model.apply, spec))
    small = take(data, 1)  # count 5 -> 2 steps/epoch -> 4 steps
    assert num_scan_steps(spec, data.x.shape[1]) == 2 * 3
    res = train(params, small, jax.random.key(3))
    exact = LocalTraining(spec.optimizer, batch_size=4, steps=4, epochs=None)
    want = make_local_train(model.apply, exact)(params, small, jax.random.key(3))
    chex.assert_trees_all_close(res.params, want.params, rtol=1e-6)
    np.testing.assert_allclose(res.loss, want.loss, rtol=1e-6)


def test_padding_rows_never_change_the_result():
    model, spec, data = _setup(steps=7)
    params = model.init(jax.random.key(0))
    train = jax.jit(make_local_train(model.apply, spec))
    junky = with_junk_rows(data, extra=9)
    for c in range(2):
        a = train(params, take(data, c), jax.random.key(5))
        b = train(params, take(junky, c), jax.random.key(5))
        chex.assert_trees_all_close(a, b, rtol=1e-6)


def test_empty_client_keeps_its_params():
    model, spec, data = _setup(steps=3, counts=(6, 0), opt=optax.adamw(0.1, weight_decay=0.1))
    params = model.init(jax.random.key(0))
    res = make_local_train(model.apply, spec)(params, take(data, 1), jax.random.key(0))
    chex.assert_trees_all_equal(res.params, params)


def test_prox_term_pulls_towards_anchor():
    model, spec, data = _setup(steps=20)
    params = model.init(jax.random.key(0))
    free = make_local_train(model.apply, spec)(params, take(data, 0), jax.random.key(1)).params
    prox = make_local_train(model.apply, spec, prox_mu=5.0)(params, take(data, 0), jax.random.key(1)).params

    def dist(p):
        return sum(float(jnp.sum((a - b) ** 2)) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(params)))

    assert dist(prox) < 0.5 * dist(free)


def test_regularizer_gradient_is_added():
    """An L1 regularizer adds lam * sign(w) to the gradient: one SGD step differs by lr*lam*sign."""
    model = build_model("mlp", (6,), 3, hidden=(8,))
    data = toy_arrays([4])
    spec = LocalTraining(optax.sgd(1.0), batch_size=4, steps=1, epochs=None)
    params = model.init(jax.random.key(1))
    lam = 0.01
    l1 = lambda p: lam * sum(jnp.sum(jnp.abs(x)) for x in jax.tree.leaves(p))
    plain = make_local_train(model.apply, spec)(params, take(data, 0), jax.random.key(0)).params
    reg = make_local_train(model.apply, spec, regularizer=l1)(params, take(data, 0), jax.random.key(0)).params
    diff = jax.tree.map(lambda a, b: a - b, plain["params"], reg["params"])
    want = jax.tree.map(lambda p: lam * jnp.sign(p), params["params"])
    # Kernels are non-zero at init, so sign() is the gradient of |w| there.
    for layer in ("hidden_0", "head"):
        chex.assert_trees_all_close(diff[layer]["kernel"], want[layer]["kernel"], atol=1e-6)


def test_default_is_one_epoch():
    assert LocalTraining(optax.sgd(0.1)).validate().epochs == 1
    assert LocalTraining(optax.sgd(0.1), steps=3).validate().epochs is None


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(steps=2, epochs=1), "exactly one"),
        (dict(steps=0, epochs=None), "steps"),
        (dict(batch_size=0), "batch_size"),
        (dict(loss="hinge"), "loss"),
    ],
)
def test_bad_local_training_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LocalTraining(optax.sgd(0.1), **kwargs).validate()


def test_padding_never_reaches_batchnorm_statistics():
    """Partial batches are filled with real rows (weight 0), so junk padding cannot
    move BatchNorm's batch statistics or running averages."""
    model = build_model("mlp_bn", (6,), 3, hidden=(8,))
    spec = LocalTraining(optax.sgd(0.1), batch_size=4, epochs=2)
    data = toy_arrays((7, 5))  # 7 and 5 rows: every epoch ends with a partial batch
    junky = with_junk_rows(data, extra=9, value=50.0)
    params = model.init(jax.random.key(0))
    train = jax.jit(make_local_train(model.apply, spec))
    for c in range(2):
        a = train(params, take(data, c), jax.random.key(4))
        b = train(params, take(junky, c), jax.random.key(4))
        # atol: the unoptimized test compilation rounds differently at the two n_max (4e-9 seen on
        # entries near 0); junk of 50 reaching the statistics would move them by O(1).
        chex.assert_trees_all_close(a.params, b.params, rtol=1e-6, atol=1e-7)
        assert not np.allclose(a.params["batch_stats"]["bn_0"]["mean"], 0.0)


def test_step_batch_covers_each_epochs_real_rows_once_and_stops_after_the_epochs():
    from pfljax.core.local import batches_per_epoch, step_batch

    key, count, n_max = jax.random.key(3), jnp.int32(10), 16
    spec = LocalTraining(optax.sgd(0.1), batch_size=4, epochs=2)
    per_epoch = int(batches_per_epoch(count, 4))
    assert per_epoch == 3
    fn = jax.jit(lambda s: step_batch(spec, key, s, count, n_max))
    for epoch in range(2):
        seen = []
        for j in range(per_epoch):
            rows, w, active = fn(jnp.int32(epoch * per_epoch + j))
            assert bool(active)
            seen += [int(r) for r, wi in zip(rows, w) if wi == 1.0]
        assert sorted(seen) == list(range(10))
    # Step s is batch s % E of epoch s // E of the library's epoch order.
    rows, _, _ = fn(jnp.int32(4))
    np.testing.assert_array_equal(rows, epoch_order(key, 1, count, n_max, 4)[4:8])
    assert not bool(fn(jnp.int32(2 * per_epoch))[2])  # past the 2 epochs
    assert not bool(step_batch(spec, key, jnp.int32(0), jnp.int32(0), n_max)[2])  # empty client


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("steps,epochs", [(None, 2), (3, None)])
def test_while_loop_equals_masked_scan(steps, epochs, drop_last):
    """Clients of 0, 1, 5 and 13 rows: the "while" loop (only each client's own steps)
    gives the masked scan's numbers, bit for bit one client at a time (lax.map) and to
    float rounding when vmapped (where a batch runs its largest client's steps); with
    drop_last too (floor(n / 4) full batches per epoch: the 1-row client takes no step)."""
    model = build_model("mlp", (6,), 3, hidden=(8,))
    data = toy_arrays([0, 1, 5, 13])
    params = model.init(jax.random.key(1))
    keys = jax.random.split(jax.random.key(2), 4)

    def run(loop, mapper):
        spec = LocalTraining(optax.sgd(0.1, momentum=0.9), 4, steps, epochs, loop=loop, drop_last=drop_last)
        train = make_local_train(model.apply, spec)
        return jax.jit(
            lambda: mapper(lambda a: train(params, take(data, a[0]), a[1]), (jnp.arange(4), keys))
        )()

    scan = run("scan", lambda f, xs: jax.lax.map(f, xs))
    chex.assert_trees_all_equal(run("while", lambda f, xs: jax.lax.map(f, xs)), scan)
    chex.assert_trees_all_close(run("while", lambda f, xs: jax.vmap(f)(xs)), scan, rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_equal(jax.tree.map(lambda a: a[0], scan.params), params)  # the empty client
    if drop_last:  # E * floor(n / 4), or S; none below 4 rows
        want = [0, 0, 2, 6] if epochs else [0, 0, 3, 3]
        chex.assert_trees_all_equal(jax.tree.map(lambda a: a[1], scan.params), params)
    else:  # E * ceil(n / 4), or S
        want = [0, 2, 4, 8] if epochs else [0, 3, 3, 3]
    np.testing.assert_array_equal(
        own_steps(LocalTraining(optax.sgd(0.1), 4, steps, epochs, drop_last=drop_last), data.count), want
    )


def test_drop_last_epoch_is_the_full_batches_of_the_same_epoch_order():
    """drop_last: an epoch of 13 rows at B=4 is 3 full batches (the 13th row sits out),
    the first 3 batches of the order the default schedule would use: one drop_last
    epoch equals 3 steps of the default schedule, bit for bit; every batch weighs 1."""
    from pfljax.core.local import batches_per_epoch, step_batch

    model = build_model("mlp", (6,), 3, hidden=(8,))
    data, params, key = toy_arrays([13]), model.init(jax.random.key(1)), jax.random.key(7)
    dropped = LocalTraining(optax.sgd(0.1, momentum=0.9), 4, epochs=1, drop_last=True)
    three = LocalTraining(optax.sgd(0.1, momentum=0.9), 4, steps=3)
    a = make_local_train(model.apply, dropped)(params, take(data, 0), key)
    b = make_local_train(model.apply, three)(params, take(data, 0), key)
    chex.assert_trees_all_equal(a, b)
    assert int(batches_per_epoch(jnp.int32(13), 4, drop_last=True)) == 3
    assert int(batches_per_epoch(jnp.int32(3), 4, drop_last=True)) == 0
    assert num_scan_steps(dropped, 13) == 3 and num_scan_steps(dropped._replace(epochs=2), 15) == 6
    spec = dropped._replace(epochs=2)
    for epoch in range(2):
        seen = []
        for j in range(3):
            rows, w, active = step_batch(spec, key, jnp.int32(3 * epoch + j), jnp.int32(13), 13)
            assert bool(active) and w.tolist() == [1.0] * 4
            seen += rows.tolist()
        assert len(set(seen)) == 12 and max(seen) < 13  # 12 distinct real rows per epoch
    assert not bool(step_batch(spec, key, jnp.int32(6), jnp.int32(13), 13)[2])  # past the 2 epochs
    with pytest.raises(ValueError, match="drop_last must be True or False"):
        LocalTraining(optax.sgd(0.1), drop_last="yes").validate()


def test_epoch_orders_drawn_before_the_steps_give_the_same_training(monkeypatch):
    """`epoch_orders` (every epoch's order drawn once, before the steps) are `epoch_order`'s,
    and training with them is the training that draws each epoch's order at its start
    (MAX_PLANNED_ROWS = 0 forces that path): bit for bit one client at a time (map) and in a
    vmapped while loop, to float rounding in a vmapped scan; in steps mode (no static epoch
    count) nothing is drawn ahead."""
    from pfljax.core import local

    key, count = jax.random.key(5), jnp.int32(9)
    spec = LocalTraining(optax.sgd(0.1), batch_size=4, epochs=3)
    orders = local.epoch_orders(spec, key, count, 13)
    chex.assert_shape(orders, (3, 13 + 4))
    for e in range(3):
        np.testing.assert_array_equal(orders[e], epoch_order(key, e, count, 13, 4))
    assert local.epoch_orders(spec._replace(epochs=None, steps=5), key, count, 13) is None
    model = build_model("mlp", (6,), 3, hidden=(8,))
    data, params = toy_arrays([0, 3, 9, 13]), model.init(jax.random.key(1))
    keys = jax.random.split(jax.random.key(2), 4)

    def run(loop, mapper):
        train = make_local_train(model.apply, spec._replace(loop=loop, optimizer=optax.adam(0.01)))
        return jax.jit(
            lambda: mapper(lambda a: train(params, take(data, a[0]), a[1]), (jnp.arange(4), keys))
        )()

    mappers = {"map": lambda f, xs: jax.lax.map(f, xs), "vmap": lambda f, xs: jax.vmap(f)(xs)}
    ahead = {(loop, m): run(loop, f) for loop in ("scan", "while") for m, f in mappers.items()}
    monkeypatch.setattr(local, "MAX_PLANNED_ROWS", 0)
    for (loop, m), got in ahead.items():
        if (loop, m) == ("scan", "vmap"):  # another program: XLA's fusion rounds 1 ulp apart (6e-8 seen)
            chex.assert_trees_all_close(got, run(loop, mappers[m]), rtol=1e-6, atol=1e-7)
        else:
            chex.assert_trees_all_equal(got, run(loop, mappers[m]))


def test_grad_through_a_round_with_the_default_loop_equals_the_scans_and_finite_differences():
    """`jax.grad` of a FedAvg round's result with respect to the client learning rate and to
    the starting weights: the "while" loop (the CPU default) differentiates as the masked scan
    does, and the learning-rate derivative matches a central finite difference (on a linear
    softmax model: with ReLU units the trained weights jump where a unit's derivative does)."""
    import pfljax

    fd = pfljax.build_federated_data("simulation", 4, source_kwargs={"samples_per_client": 23})
    model = build_model("mlp", fd.input_shape, fd.num_classes, hidden=())

    def final_loss(lr, params, loop):
        local = LocalTraining(optax.sgd(lr), batch_size=5, epochs=2, loop=loop)
        alg = pfljax.fedavg.build(model, local, clients_per_round=4)
        state = alg.init(jax.random.key(0), None, 4)
        state = state._replace(global_params=params)
        state, _ = alg.round(state, fd.data, jax.random.key(1))
        return jnp.mean(alg.evaluate(state, fd.data, jax.random.key(2))["loss"])

    params = (
        pfljax.fedavg.build(model, LocalTraining(optax.sgd(0.1)), clients_per_round=4)
        .init(jax.random.key(0), None, 4)
        .global_params
    )
    grads = {
        loop: jax.jit(jax.grad(final_loss, argnums=(0, 1)), static_argnums=2)(0.1, params, loop)
        for loop in ("while", "scan")
    }
    chex.assert_trees_all_close(grads["while"], grads["scan"], rtol=1e-5, atol=1e-6)
    h = 1e-3
    fdiff = (final_loss(0.1 + h, params, "while") - final_loss(0.1 - h, params, "while")) / (2 * h)
    np.testing.assert_allclose(grads["while"][0], fdiff, rtol=2e-2)
    assert float(jnp.abs(grads["while"][0])) > 1e-3
