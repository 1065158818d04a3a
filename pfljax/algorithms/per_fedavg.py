"""Per-FedAvg (Fallah et al., "Personalized Federated Learning with Theoretical Guarantees:
A Model-Agnostic Meta-Learning Approach", NeurIPS 2020).

Each sampled client runs local meta-steps on the MAML objective
f(w - alpha * grad f(w)): with three independent minibatches D, D', D'' of its
own rows,
    w_tmp = w - alpha * grad f(w; D)
    g     = grad f(w_tmp; D')
    w    <- w - beta * g                                     ("fo", first order)
    w    <- w - beta * (g - alpha * H(w; D'') g)             ("hf", Hessian-free)
where H(w; D'') g is the paper's finite-difference estimate
(grad f(w + delta g; D'') - grad f(w - delta g; D'')) / (2 delta); "hf_exact"
uses the exact Hessian-vector product (forward-over-reverse autodiff) instead.
With ReLU networks the finite difference can straddle a kink, where the
gradient jumps and the jump is divided by 2 delta, so "hf" can land far from
"hf_exact"; on smooth losses the two agree to 1e-5 (tests/algorithms/test_per_fedavg.py).
The outer step is `local.optimizer` (beta = its learning rate; the paper uses
plain SGD). The server averages the returned models uniformly, as the paper's
Algorithm 1 (`weighting="samples"` weights by train size, as the pFedMe
authors' reimplementation does). Evaluation personalizes first: each client
takes `adapt_steps` (paper: 1) plain SGD steps of size alpha on minibatches of
its train rows, then tests.

Schedule: `local.steps` = meta-steps per round; with `local.epochs` = E, a
client takes ceil(E * ceil(n / B) / m) meta-steps, m = 2 ("fo") or 3 ("hf*")
minibatches per meta-step. alpha defaults to 0.01 (the paper tunes alpha and
beta per dataset).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pfljax.algorithms import fedavg
from pfljax.core import aggregate
from pfljax.core import params as P
from pfljax.core.batches import batches_per_epoch, stream_batch
from pfljax.core.clients import ClientMap, as_client_map, client_key, round_keys, take
from pfljax.core.evaluate import evaluate_clients
from pfljax.core.local import LocalTraining, num_scan_steps
from pfljax.core.losses import get_loss, masked_mean
from pfljax.core.sampling import check_clients_per_round, sample_clients
from pfljax.core.types import Algorithm, ClientArrays, ClientData
from pfljax.models.base import Model

VARIANTS = ("fo", "hf", "hf_exact")
EVAL_KEY = 0x5EED


class PerFedAvgState(NamedTuple):
    global_params: Any  # the meta-model (full variables)
    round: jax.Array


def make_batch_grad(apply_fn, loss):
    """grad_fn(params, rest, x, y, w) -> ((loss, updates), grads) of one weighted minibatch."""
    loss = get_loss(loss)

    def batch_loss(params, rest, xb, yb, wb):
        out, updates = apply_fn({**rest, "params": params}, xb, train=True)
        return masked_mean(loss.per_example(out, yb), wb), updates

    return jax.value_and_grad(batch_loss, has_aux=True)


def sgd_step(params, grads, lr):
    return jax.tree.map(lambda p, g: p - lr * g, params, grads)


def make_adapt(apply_fn, local: LocalTraining, alpha: float, steps: int):
    """adapt(variables, data, key) -> variables after `steps` SGD steps of size alpha."""
    value_and_grad = make_batch_grad(apply_fn, local.loss)

    def adapt(variables, data: ClientArrays, key):
        params = variables["params"]
        rest = {k: v for k, v in variables.items() if k != "params"}
        for b in range(steps):
            rows, w = stream_batch(key, jnp.int32(b), data.count, data.x.shape[0], local.batch_size)
            (_, updates), g = value_and_grad(params, rest, data.x[rows], data.y[rows], w)
            params, rest = sgd_step(params, g, alpha), {**rest, **updates}
        return {**rest, "params": params}

    return adapt


def make_meta_train(apply_fn, local: LocalTraining, alpha: float, variant: str, delta: float):
    """train(variables, data, key) -> (variables, mean meta-loss) for ONE client."""
    value_and_grad = make_batch_grad(apply_fn, local.loss)
    per_step = 2 if variant == "fo" else 3
    bsz, optimizer = local.batch_size, local.optimizer

    def train(variables, data: ClientArrays, key):
        n_max = data.x.shape[0]
        if local.steps is not None:
            steps, total = local.steps, None
        else:
            steps = -(-num_scan_steps(local, n_max) // per_step)
            total = local.epochs * batches_per_epoch(data.count, bsz)

        def batch(b):
            rows, w = stream_batch(key, b, data.count, n_max, bsz)
            return data.x[rows], data.y[rows], w

        def step(carry, s):
            params, rest, opt_state = carry
            (_, _), g1 = value_and_grad(params, rest, *batch(s * per_step))
            (loss, updates), g = value_and_grad(sgd_step(params, g1, alpha), rest, *batch(s * per_step + 1))
            if variant != "fo":
                xb, yb, wb = batch(s * per_step + 2)

                def grad_at(p):
                    return value_and_grad(p, rest, xb, yb, wb)[1]

                if variant == "hf_exact":
                    hvp = jax.jvp(grad_at, (params,), (g,))[1]
                else:
                    plus = grad_at(jax.tree.map(lambda p, v: p + delta * v, params, g))
                    minus = grad_at(jax.tree.map(lambda p, v: p - delta * v, params, g))
                    hvp = jax.tree.map(lambda a, b: (a - b) / (2 * delta), plus, minus)
                g = jax.tree.map(lambda gi, h: gi - alpha * h, g, hvp)
            upd, new_opt = optimizer.update(g, opt_state, params)
            new = (optax.apply_updates(params, upd), {**rest, **updates}, new_opt)
            active = data.count > 0
            if total is not None:
                active &= s * per_step < total
            kept = jax.tree.map(lambda a, b: jnp.where(active, a, b), new, carry)
            return kept, (loss * active, active)

        params = variables["params"]
        rest = {k: v for k, v in variables.items() if k != "params"}
        init = (params, rest, optimizer.init(params))
        (params, rest, _), (losses, active) = jax.lax.scan(step, init, jnp.arange(steps))
        return {**rest, "params": params}, jnp.sum(losses) / jnp.maximum(jnp.sum(active), 1)

    return train


def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    alpha: float = 0.01,
    variant: str = "fo",
    delta: float = 1e-3,
    adapt_steps: int = 1,
    weighting: str = "uniform",
) -> Algorithm:
    """Per-FedAvg.

    Args:
      alpha: inner (personalization) step size, also used for the evaluation-time adaptation.
      variant: "fo" (first order), "hf" (Hessian-free, finite differences) or
        "hf_exact" (exact Hessian-vector product).
      delta: finite-difference step of "hf".
      adapt_steps: SGD steps of size alpha before each client's evaluation.
      weighting: "uniform" (paper) or "samples".
      Others: as fedavg.build; beta is the learning rate of `local.optimizer`.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if weighting not in fedavg.WEIGHTINGS:
        raise ValueError(f"weighting must be one of {fedavg.WEIGHTINGS}, got {weighting!r}")
    if alpha <= 0 or delta <= 0:
        raise ValueError(f"alpha and delta must be > 0, got alpha={alpha}, delta={delta}")
    if adapt_steps < 0:
        raise ValueError(f"adapt_steps must be >= 0, got {adapt_steps}")
    local = local.validate()
    cmap = as_client_map(client_map)
    train = make_meta_train(model.apply, local, alpha, variant, delta)
    adapt = make_adapt(model.apply, local, alpha, adapt_steps)
    model_bytes = P.tree_bytes(jax.eval_shape(model.init, jax.random.key(0)))

    def init(key, params_template=None, num_clients: int = 1) -> PerFedAvgState:
        params = model.init(key) if params_template is None else params_template
        return PerFedAvgState(params, jnp.zeros([], jnp.int32))

    def round_fn(state: PerFedAvgState, data: ClientData, key):
        num = data.train.count.shape[0]
        k = check_clients_per_round(clients_per_round, num)
        sample_key, train_key = round_keys(key, state.round)
        idx = sample_clients(sample_key, num, k)

        def client_update(cid):
            return train(state.global_params, take(data.train, cid), client_key(train_key, cid))

        new, losses = cmap(client_update, idx)
        weights = fedavg.client_weights(weighting, data.train.count[idx])
        metrics = {
            "train_loss": jnp.sum(aggregate.normalized_weights(weights) * losses),
            "bytes_up": jnp.float32(k * model_bytes),
            "bytes_down": jnp.float32(k * model_bytes),
            "participants": jnp.int32(k),
        }
        return PerFedAvgState(aggregate.weighted_mean(new, weights), state.round + 1), metrics

    def evaluate(state: PerFedAvgState, data: ClientData):
        key = jax.random.fold_in(jax.random.key(EVAL_KEY), state.round)

        def adapted(c):
            return adapt(state.global_params, take(data.train, c), jax.random.fold_in(key, c))

        return evaluate_clients(model.apply, adapted, data.test, cmap, local.loss)

    return Algorithm(init, round_fn, evaluate)
