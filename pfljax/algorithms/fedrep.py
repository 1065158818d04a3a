"""FedRep (Collins et al., "Exploiting Shared Representations for Personalized Federated
Learning", ICML 2021).

Each round, a sampled client starts from the global representation (body) and
its own head, then
1. trains the head for `head_epochs` epochs with the body frozen,
2. trains the body with the head frozen, for the local schedule of `local`
   (LocalTraining steps or epochs);
only the body is sent and averaged (weighted by train size); heads stay local.
Freezing masks updates with `optax.multi_transform(..., set_to_zero)`, so the
frozen leaves do not move (nor do momentum or weight decay act on them); each
phase starts a fresh optimizer state.

Defaults follow the paper and its code (`--local_ep 11 --local_rep_ep 1`): 10
head epochs, then 1 body epoch (`local.epochs=1`), head = the last layer
(`head_layers=1`; BatchNorm statistics of head layers stay local with it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from pfljax.algorithms import fedavg
from pfljax.core import aggregate
from pfljax.core import params as P
from pfljax.core.clients import ClientMap, as_client_map, client_key, gather, round_keys, scatter, take
from pfljax.core.layers import last_layers
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.sampling import check_clients_per_round, sample_clients
from pfljax.core.types import Algorithm, ClientData
from pfljax.models.base import Model


def frozen(optimizer: optax.GradientTransformation, trainable: dict) -> optax.GradientTransformation:
    """`optimizer` on leaves where `trainable` (a bool tree over "params") is True, zero updates elsewhere."""
    labels = jax.tree.map(lambda t: "train" if t else "freeze", trainable)
    return optax.multi_transform({"train": optimizer, "freeze": optax.set_to_zero()}, labels)


def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    head_layers: int = 1,
    head_epochs: int = 10,
    server_lr: float = 1.0,
    weighting: str = "samples",
) -> Algorithm:
    """FedRep: alternate head epochs (body frozen) and body training (head frozen); body averaged.

    Args:
      head_layers: number of last layers forming the personal head.
      head_epochs: local epochs on the head per round (paper: 10).
      Others: as fedavg.build; `local` sets the optimizer, batch size and the
        body phase's steps/epochs (paper: 1 epoch).
    """
    if head_epochs < 1:
        raise ValueError(f"head_epochs must be >= 1, got {head_epochs}")
    if weighting not in fedavg.WEIGHTINGS:
        raise ValueError(f"weighting must be one of {fedavg.WEIGHTINGS}, got {weighting!r}")
    local = local.validate()
    cmap = as_client_map(client_map)
    template = jax.eval_shape(model.init, jax.random.key(0))
    is_head = P.match_paths(template, last_layers(model, head_layers, argument="head_layers"))
    head_params = is_head["params"]
    body_params = jax.tree.map(lambda h: not h, head_params)
    train_head = make_local_train(
        model.apply,
        local._replace(optimizer=frozen(local.optimizer, head_params), steps=None, epochs=head_epochs),
    )
    train_body = make_local_train(model.apply, local._replace(optimizer=frozen(local.optimizer, body_params)))
    body_bytes = P.tree_bytes(P.split(template, is_head)[0])
    # FedAvg with the head local has FedRep's state, init and evaluation.
    base = fedavg.build(model, local, client_map=client_map, local_leaves=last_layers(model, head_layers))

    def round_fn(state: fedavg.FedAvgState, data: ClientData, key):
        num = data.train.count.shape[0]
        k = check_clients_per_round(clients_per_round, num)
        sample_key, train_key = round_keys(key, state.round)
        idx = sample_clients(sample_key, num, k)

        def client_update(args):
            cid, head_c = args
            rows, ckey = take(data.train, cid), client_key(train_key, cid)
            h = train_head(P.merge(state.global_params, head_c), rows, jax.random.fold_in(ckey, 0))
            b = train_body(h.params, rows, jax.random.fold_in(ckey, 1))
            body_new, head_new = P.split(b.params, is_head)
            return body_new, head_new, h.loss, b.loss

        body_new, head_new, head_loss, body_loss = cmap(
            client_update, (idx, gather(state.client_params, idx))
        )
        weights = fedavg.client_weights(weighting, data.train.count[idx])
        body_old, _ = P.split(state.global_params, is_head)
        body = aggregate.server_step(body_old, aggregate.weighted_mean(body_new, weights), server_lr)
        new_state = fedavg.FedAvgState(
            P.merge(state.global_params, body), scatter(state.client_params, idx, head_new), state.round + 1
        )
        w = aggregate.normalized_weights(weights)
        metrics = {
            "train_loss": jnp.sum(w * body_loss),
            "head_loss": jnp.sum(w * head_loss),
            "bytes_up": jnp.float32(k * body_bytes),
            "bytes_down": jnp.float32(k * body_bytes),
            "participants": jnp.int32(k),
        }
        return new_state, metrics

    return Algorithm(base.init, round_fn, base.evaluate)
