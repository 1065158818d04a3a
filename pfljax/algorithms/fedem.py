"""FedEM (Marfoq et al., "Federated Multi-Task Learning under a Mixture of
Distributions", NeurIPS 2021).

Every client's data distribution is a mixture of M shared components: the
server holds M component models h_1..h_M, client t holds mixture weights
pi_t [M]. One round, for each sampled client t (Algorithm 1 of the paper):

1. E-step on its train rows: q_t(z_i = m) ∝ pi_tm * exp(-loss(h_m(x_i), y_i));
2. M-step: pi_t = mean_i q_t(z_i);
3. every component m is trained locally from the server's h_m with sample
   weights q_t(z_i = m) (batch loss: mean over the batch of q * loss, as in the
   released code);
4. the server averages each component over the participants, weighted by train
   size.

Prediction is the client's mixture: p(y | x) = sum_m pi_tm softmax(h_m(x))
(for "mse", the pi-weighted mean output). Paper and released code agree on all
of the above; the code's persistent client optimizers are not kept (local
optimizer state starts afresh each round, as everywhere in pfljax).

State: `global_components` has a leading component axis M (not a client axis);
`client_mixture` [C, M].
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pfljax.core import aggregate
from pfljax.core import params as P
from pfljax.core.clients import (
    ClientMap,
    as_client_map,
    client_key,
    gather,
    round_keys,
    scatter,
    stack,
    take,
)
from pfljax.core.evaluate import predict_rows, scores_from_outputs
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.losses import Loss, get_loss
from pfljax.core.sampling import check_clients_per_round, sample_clients
from pfljax.core.types import Algorithm, ClientArrays, ClientData
from pfljax.models.base import Model

LOSSES = ("cross_entropy", "mse")


class FedEMState(NamedTuple):
    global_components: Any  # variables with leaves [M, ...]
    client_mixture: jax.Array  # [C, M] mixture weights pi
    round: jax.Array


def em_posterior(log_pi: jax.Array, losses: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One EM iteration of one client.

    Args:
      log_pi: [M] log mixture weights.
      losses: [M, n] per-row loss of each component (negative log-likelihood).
      valid: [n] 1 for real rows, 0 for padding.

    Returns:
      q: [M, n] posterior q(z_i = m) (0 on padding), each real column sums to 1.
      pi: [M] new mixture weights, mean of q over real rows (log_pi's weights
        unchanged when there are no rows).
    """
    q = jax.nn.softmax(log_pi[:, None] - losses, axis=0) * valid[None, :]
    n = jnp.sum(valid)
    pi = jnp.where(n > 0, jnp.sum(q, axis=1) / jnp.maximum(n, 1.0), jnp.exp(log_pi))
    return q, pi


def sample_weighted(loss: Loss) -> Loss:
    """`loss` on packed targets [B, t + 1]: target in the leading columns, the
    row's weight in the last; per_example = weight * loss(out, target)."""
    if loss.name not in LOSSES:
        raise ValueError(f"fedem supports loss in {LOSSES}, got {loss.name!r}")

    def unpack(yw):
        target = yw[:, 0].astype(jnp.int32) if loss.name == "cross_entropy" else yw[:, :-1]
        return target, yw[:, -1]

    def per_example(out, yw):
        target, w = unpack(yw)
        return w * loss.per_example(out, target)

    def score(out, yw):
        return loss.score(out, unpack(yw)[0])

    return Loss(f"weighted_{loss.name}", per_example, score)


def pack_targets(y: jax.Array, weights: jax.Array) -> jax.Array:
    """y [n] or [n, ...] and weights [n] -> float32 [n, t + 1]."""
    flat = y.reshape(y.shape[0], -1).astype(jnp.float32)
    return jnp.concatenate([flat, weights[:, None].astype(jnp.float32)], axis=1)


def mixture_output(loss: Loss, outputs: jax.Array, pi: jax.Array) -> jax.Array:
    """Mixture prediction from component outputs [M, B, ...] and pi [M]: log of
    sum_m pi_m softmax(out_m) (cross_entropy), or sum_m pi_m out_m (mse)."""
    if loss.name == "cross_entropy":
        log_p = jax.nn.log_softmax(outputs, axis=-1)
        log_w = jnp.log(jnp.maximum(pi, 1e-30)).reshape((-1,) + (1,) * (outputs.ndim - 1))
        return jax.nn.logsumexp(log_w + log_p, axis=0)
    return jnp.tensordot(pi, outputs, axes=1)


def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    num_components: int = 3,
) -> Algorithm:
    """FedEM with `num_components` shared components (the paper's default: 3).

    Args:
      model: the component model (all components share its architecture).
      local: local training of each component (every component takes these
        steps/epochs each round).
      clients_per_round: K clients sampled per round (None: all).
      client_map: client-axis mapping strategy; it maps over the K clients for
        the E-step and over the K * M (client, component) pairs for training.
      num_components: M >= 1.
    """
    if num_components < 1:
        raise ValueError(f"num_components must be >= 1, got {num_components}")
    cmap = as_client_map(client_map)
    loss = get_loss(local.loss)
    weighted = sample_weighted(loss)
    train = make_local_train(model.apply, local._replace(loss=weighted))
    m_count = num_components
    template = jax.eval_shape(model.init, jax.random.key(0))
    model_bytes = P.tree_bytes(template)

    def init(key, params_template=None, num_clients: int = 1) -> FedEMState:
        """Components from independent inits (with a template: component 0 is
        the template, the others fresh inits); uniform mixture weights."""
        comps = [model.init(jax.random.fold_in(key, m)) for m in range(m_count)]
        if params_template is not None:
            comps[0] = params_template
        pi = jnp.full((num_clients, m_count), 1.0 / m_count, jnp.float32)
        return FedEMState(stack(comps), pi, jnp.zeros([], jnp.int32))

    def component_losses(components, arrays: ClientArrays) -> jax.Array:
        """[M, n_max] per-row loss of every component on one client's rows."""

        def one(variables):
            out = predict_rows(lambda xb: model.apply(variables, xb, train=False)[0], arrays.x)
            return loss.per_example(out, arrays.y)

        return jax.lax.map(one, components)

    def round_fn(state: FedEMState, data: ClientData, key):
        num = data.train.count.shape[0]
        k = check_clients_per_round(clients_per_round, num)
        sample_key, train_key = round_keys(key, state.round)
        idx = sample_clients(sample_key, num, k)

        def e_step(args):
            cid, pi = args
            arrays = take(data.train, cid)
            valid = (jnp.arange(arrays.y.shape[0]) < arrays.count).astype(jnp.float32)
            losses = component_losses(state.global_components, arrays)
            log_pi = jnp.log(jnp.maximum(pi, 1e-30))
            q, new_pi = em_posterior(log_pi, losses, valid)
            nll = -jnp.sum(jax.nn.logsumexp(log_pi[:, None] - losses, axis=0) * valid)
            return q, new_pi, nll / jnp.maximum(jnp.sum(valid), 1.0)

        q, new_pi, nll = cmap(e_step, (idx, gather(state.client_mixture, idx)))

        def component_update(args):
            cid, m, q_row = args
            arrays = take(data.train, cid)
            packed = arrays._replace(y=pack_targets(arrays.y, q_row))
            start = take(state.global_components, m)
            res = train(start, packed, jax.random.fold_in(client_key(train_key, cid), m))
            return res.params, res.loss

        pair_cid = jnp.repeat(idx, m_count)
        pair_m = jnp.tile(jnp.arange(m_count), k)
        pair_q = q.reshape((k * m_count,) + q.shape[2:])
        trained, _ = cmap(component_update, (pair_cid, pair_m, pair_q))
        trained = jax.tree.map(lambda x: x.reshape((k, m_count) + x.shape[1:]), trained)
        weights = data.train.count[idx].astype(jnp.float32)
        components = aggregate.weighted_mean(trained, weights)
        mixture = scatter(state.client_mixture, idx, new_pi)
        new_state = FedEMState(components, mixture, state.round + 1)
        metrics = {
            "train_loss": jnp.sum(aggregate.normalized_weights(weights) * nll),
            "bytes_up": jnp.float32(k * m_count * model_bytes),
            "bytes_down": jnp.float32(k * m_count * model_bytes),
            "participants": jnp.int32(k),
            "mixture_weights": mixture,
        }
        return new_state, metrics

    def evaluate(state: FedEMState, data: ClientData):
        def one(cid):
            arrays = take(data.test, cid)
            pi = state.client_mixture[cid]

            def predict(xb):
                outs = jax.lax.map(lambda v: model.apply(v, xb, train=False)[0], state.global_components)
                return mixture_output(loss, outs, pi)

            return scores_from_outputs(predict_rows(predict, arrays.x), arrays, loss)

        return cmap(one, jnp.arange(data.test.count.shape[0]))

    return Algorithm(init, round_fn, evaluate)
