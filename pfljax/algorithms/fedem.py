"""FedEM (Marfoq et al., "Federated Multi-Task Learning under a Mixture of
Distributions", NeurIPS 2021).

Every client's data distribution is a mixture of M shared components: the
server holds M component models h_1..h_M, client t holds mixture weights
pi_t [M]. One round, for each sampled client t (Algorithm 1 of the paper):

1. E-step on its train rows: q_t(z_i = m) ∝ pi_tm * exp(-loss(h_m(x_i), y_i))
   (`pfljax.core.mixture.posterior`);
2. M-step: pi_t = mean_i q_t(z_i) (`em_iteration` does both);
3. every component m is trained locally from the server's h_m with sample
   weights q_t(z_i = m) (batch loss: mean over the batch of q * loss, as in the
   released code);
4. the server averages each component over the participants, weighted by train
   size.

Prediction is the client's mixture: p(y | x) = sum_m pi_tm softmax(h_m(x))
(for "mse", the pi-weighted mean output; `pfljax.core.mixture.predict`). Paper
and released code agree on all of the above; the code's persistent client
optimizers are not kept (local optimizer state starts afresh each round, as
everywhere in pfljax).

The round is `pfljax.core.round.client_step`: a participant's `client_update`
runs its E-step and trains the M components (mapped with the client map, so
under "vmap" all K * M trainings run side by side); `server_update` averages.

State: `global_components` has a leading component axis M (not a client axis);
`client_mixture` [C, M].
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pfljax.core import mixture
from pfljax.core import params as P
from pfljax.core.clients import ClientMap, as_client_map, stack, take
from pfljax.core.domains import Domain, checked
from pfljax.core.evaluate import predict_rows, scores_from_outputs
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.losses import Loss, get_loss
from pfljax.core.round import Participants, client_step, federated_round
from pfljax.core.types import Algorithm, ClientArrays, ClientData
from pfljax.models.base import Model

LOSSES = ("cross_entropy", "mse")


class FedEMState(NamedTuple):
    global_components: Any  # variables with leaves [M, ...]
    client_mixture: jax.Array  # [C, M] mixture weights pi
    round: jax.Array


class FedEMHyper(NamedTuple):
    """What the pieces of a FedEM round need: the component model, its loss,
    the sample-weighted local trainer, M and the client map."""

    model: Model
    loss: Loss
    train: Callable
    num_components: int
    client_map: Callable


def em_iteration(log_pi: jax.Array, losses: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One EM iteration of one client: the posterior of each row's component
    (E-step) and the new mixture weights (M-step).

    Args:
      log_pi: [M] log mixture weights.
      losses: [M, n] per-row loss of each component (negative log-likelihood).
      valid: [n] 1 for real rows, 0 for padding.

    Returns:
      q: [M, n] posterior q(z_i = m) (0 on padding), each real column sums to 1.
      pi: [M] new mixture weights, mean of q over real rows (log_pi's weights
        unchanged when there are no rows).
    """
    q = mixture.posterior(losses, log_pi[:, None], axis=0) * valid[None, :]
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


def init(hp: FedEMHyper, key, params_template=None, num_clients: int = 1) -> FedEMState:
    """Components from independent inits (with a template: component 0 is
    the template, the others fresh inits); uniform mixture weights."""
    comps = [hp.model.init(jax.random.fold_in(key, m)) for m in range(hp.num_components)]
    if params_template is not None:
        comps[0] = params_template
    pi = jnp.full((num_clients, hp.num_components), 1.0 / hp.num_components, jnp.float32)
    return FedEMState(stack(comps), pi, jnp.zeros([], jnp.int32))


def component_losses(hp: FedEMHyper, components, arrays: ClientArrays) -> jax.Array:
    """[M, n_max] per-row loss of every component on one client's rows."""

    def one(variables):
        out = predict_rows(lambda xb: hp.model.apply(variables, xb, train=False)[0], arrays.x)
        return hp.loss.per_example(out, arrays.y)

    return jax.lax.map(one, components)


def e_step(hp: FedEMHyper, components, pi: jax.Array, data: ClientArrays):
    """One client's posterior q [M, n_max], new weights pi [M] and mean NLL of its rows."""
    valid = (jnp.arange(data.y.shape[0]) < data.count).astype(jnp.float32)
    losses = component_losses(hp, components, data)
    log_pi = jnp.log(jnp.maximum(pi, 1e-30))
    q, new_pi = em_iteration(log_pi, losses, valid)
    nll = -jnp.sum(mixture.log_evidence(losses, log_pi[:, None], axis=0) * valid)
    return q, new_pi, nll / jnp.maximum(jnp.sum(valid), 1.0)


def train_component(hp: FedEMHyper, components, data: ClientArrays, key, args):
    """Component m trained from the server's on the client's rows weighted by q_m."""
    m, q_row = args
    packed = data._replace(y=pack_targets(data.y, q_row))
    return hp.train(take(components, m), packed, jax.random.fold_in(key, m)).params


def own_mixture(state: FedEMState, part: Participants) -> jax.Array:
    """What a participant brings to the round: its mixture weights [K, M]."""
    return part.gather(state.client_mixture)


def client_update(hp: FedEMHyper, state: FedEMState, cid, pi, data: ClientArrays, key):
    """ONE client: E-step, then its M components trained (key fold_in(key, m))."""
    q, new_pi, nll = e_step(hp, state.global_components, pi, data)
    train = functools.partial(train_component, hp, state.global_components, data, key)
    trained = hp.client_map(train, (jnp.arange(hp.num_components), q))
    return (trained, new_pi), nll


def server_update(hp: FedEMHyper, state: FedEMState, outputs, part: Participants):
    """Components: train-size-weighted means; participants' mixture weights stored."""
    trained, new_pi = outputs
    mixture_weights = part.scatter(state.client_mixture, new_pi)
    new_state = state._replace(global_components=part.mean(trained), client_mixture=mixture_weights)
    return new_state, {"mixture_weights": mixture_weights}


def evaluate(hp: FedEMHyper, state: FedEMState, data: ClientData, key):
    """Each client's mixture prediction on its test rows. Deterministic: `key` is unused."""
    del key

    def one(cid):
        arrays = take(data.test, cid)
        pi = state.client_mixture[cid]

        def predict(xb):
            outs = jax.lax.map(lambda v: hp.model.apply(v, xb, train=False)[0], state.global_components)
            return mixture.predict(outs, pi, hp.loss.name)

        return scores_from_outputs(predict_rows(predict, arrays.x), arrays, hp.loss)

    return hp.client_map(one, jnp.arange(data.test.count.shape[0]))


# Why the clients cannot live in host memory (pfljax.runtime.offload).
HOST_STORAGE_REFUSED = (
    "its round reports every client's mixture weights ([C, M], a trace of all C clients each round)"
)

DOMAINS = {"num_components": Domain(1, integer=True)}


@checked(DOMAINS)
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
      client_map: client-axis mapping strategy; it maps over the K clients and,
        inside each, over its M components.
      num_components: M >= 1.
    """
    cmap = as_client_map(client_map)
    loss = get_loss(local.loss)
    train = make_local_train(model.apply, local._replace(loss=sample_weighted(loss)))
    hp = FedEMHyper(model, loss, train, num_components, cmap)
    step = client_step(
        functools.partial(client_update, hp), functools.partial(server_update, hp), cmap, own_mixture
    )
    comp_bytes = num_components * P.tree_bytes(model.template())  # M models down, M up
    round_fn = federated_round(
        step, clients_per_round=clients_per_round, bytes_up=comp_bytes, bytes_down=comp_bytes
    )
    return Algorithm(functools.partial(init, hp), round_fn, functools.partial(evaluate, hp))
