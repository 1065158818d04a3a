"""FedSplit / FedFac: hidden units split into shared and personalized by factor analysis.

Wang, Tang & Li, "Factor-Assisted Federated Learning for Personalized
Optimization with Heterogeneous Data" (arXiv 2312.04281); released code
github.com/ffair/FedFac (`mnist_fac2_v2.py`, `img_utils_linux.py`).

For each layer in `layers` (Lambda), every unit (a Dense neuron or a Conv output
channel) is a variable observed through its incoming weights on the sampled
clients; `pfljax.core.factor.factor_split` marks units with a high communality
as shared. A shared unit (its kernel slice along the output axis and its bias
entry) is averaged over the sampled clients, weighted by data size, with a server
learning rate; a personalized unit keeps each client's own values. Layers outside
Lambda are averaged as in FedAvg.

- mode="static": the split is computed once, from every (non-new) client's
  weights after round 0's local training (round 0 takes all clients; it is the
  warm-up), then fixed.
- mode="dynamic": recomputed each round from the sampled clients' post-training
  weights (`split_input="updates"`: from their updates instead).
- split="random": the same per-layer number of personalized units, chosen at
  random (once in static mode, every round in dynamic mode); split="fixed": the
  first round(tau_quantile% * units) units personalized from the start (by the
  permutation symmetry of hidden units at initialization, any fixed set of that
  size is the same method; it is the simulation study's oracle split).
- mask="shared" / "personalized" (Table 8 ablation): that group's kernel slices
  are replaced by N(0, 1) draws every time a model is handed out (training start
  and evaluation), as the released code does (`--shared_remove`,
  `--private_remove`).
- New clients (Sec. 3.2): `new_client_fraction` of the clients (a random set
  fixed at init) never train. `evaluate` gives them LocalTrain models: the
  server's shared part, their personalized units (starting from their own,
  untrained values) trained locally for `new_client_epochs` epochs with
  every other parameter frozen (BatchNorm running statistics, if any, still
  update) (like the code's "fix-tune"; its README's "train-fix" trains
  the whole model, then overwrites the shared part); it also reports
  `ensemble_accuracy`: the predictive distributions of all existing clients'
  personalized models averaged (the released code averages the last round's
  sampled clients only, and also reports a majority vote).

Paper vs released code (paper is the default, the code an option):
- Factor analysis: iterated principal-axis factoring ("ipf") vs the code's
  `FactorAnalyzer` (minres: the same least-squares fit, reached by another
  iteration) or, with `--direct_eigDecom`, raw eigenvectors (method="eig",
  which also keeps G - 1 factors as the code).
- Threshold: exact rank split (tau_quantile=100 personalizes every unit) vs the
  code's `nu < percentile(nu, q)`; the code's default "mean" threshold is not
  offered.
- Bias: a unit's bias entry goes with the unit (paper); `bias_local=True` keeps
  the split layer's whole bias personal, as the code does.
- The code has no server learning rate (server_lr=1.0 is the code).

State: `global_params` is the full variables tree (server values; for Lambda
layers the shared units' averages), `client_params` {path: [C, ...]} each client's
own Lambda kernels and biases, `global_shared` {layer: [units] bool} the current
split, `client_new` [C] bool the clients that never train.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pfljax.core import aggregate
from pfljax.core import params as P
from pfljax.core.clients import (
    ClientMap,
    as_client_map,
    broadcast,
    client_key,
    gather,
    round_keys,
    scatter,
    take,
)
from pfljax.core.evaluate import evaluate_client, evaluate_clients, predict_rows, scores_from_outputs
from pfljax.core.factor import FactorSplit, check_split_args, factor_split, split_by_rank, unit_observations
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.losses import get_loss
from pfljax.core.sampling import check_clients_per_round, sample_clients
from pfljax.core.types import Algorithm, ClientData
from pfljax.models.base import Model

__all__ = ["FactorSplit", "FedFacState", "build", "factor_split", "final_report", "unit_layers"]

MODES = ("static", "dynamic")
SPLIT_INPUTS = ("weights", "updates")
SPLITS = ("factor", "random", "fixed")
MASKS = ("none", "shared", "personalized")
# `evaluate` draws LocalTrain batches from client_key(fold_in(key(EVAL_SEED), round), c)
# and mask-ablation values from fold_in of that round key with 1: deterministic.
EVAL_SEED = 0x0E7A1


class FedFacState(NamedTuple):
    global_params: Any  # full variables tree
    client_params: dict  # {path: [C, ...]} Lambda kernels and biases of every client
    global_shared: dict  # {layer: [units] bool}, True = shared unit
    client_new: jax.Array  # [C] bool: never trains
    round: jax.Array


class _Layer(NamedTuple):
    name: str
    kernel: str  # leaf path
    bias: str | None
    units: int
    fan_in: int


def unit_layers(model: Model) -> list[str]:
    """Names of the model's layers with a `kernel` leaf, in forward order."""
    template = jax.eval_shape(model.init, jax.random.key(0))
    names = [k for k, v in template["params"].items() if isinstance(v, dict) and "kernel" in v]
    if model.module is None:
        return sorted(names)
    order: list[str] = []

    def trace(variables, x):
        _, state = model.module.apply(variables, x, capture_intermediates=True, mutable=["intermediates"])
        order.extend(state["intermediates"].keys())
        return 0

    jax.eval_shape(trace, template, jax.ShapeDtypeStruct((1, *model.input_shape), jnp.float32))
    return [n for n in order if n in names] + sorted(set(names) - set(order))


def _resolve_layers(model: Model, layers: Sequence[int | str]) -> list[_Layer]:
    names = unit_layers(model)
    if isinstance(layers, (int, str)) or len(layers) == 0:
        raise ValueError(f"layers must be a non-empty tuple of indices or names from {names}, got {layers!r}")
    template = jax.eval_shape(model.init, jax.random.key(0))["params"]
    out = []
    for spec in layers:
        if isinstance(spec, (int, np.integer)) and -len(names) <= spec < len(names):
            name = names[spec]
        elif isinstance(spec, str) and spec in names:
            name = spec
        else:
            raise ValueError(f"layers entries must be indices or names from {names}, got {spec!r}")
        if any(lay.name == name for lay in out):
            raise ValueError(f"layers names {name!r} twice: {layers!r}")
        shape = template[name]["kernel"].shape
        bias = f"params/{name}/bias" if "bias" in template[name] else None
        out.append(_Layer(name, f"params/{name}/kernel", bias, shape[-1], math.prod(shape[:-1])))
    return out


def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    layers: tuple = (0,),
    kappa: float = 0.85,
    tau_quantile: float = 50.0,
    method: str = "ipf",
    mode: str = "dynamic",
    split_input: str = "weights",
    split: str = "factor",
    mask: str = "none",
    bias_local: bool = False,
    server_lr: float = 1.0,
    new_client_fraction: float = 0.0,
    new_client_epochs: int = 1,
    max_iter: int = 50,
    tol: float = 1e-3,
) -> Algorithm:
    """FedFac with a factor-analysis split of the units of `layers`.

    Args:
      model: the client model.
      local: local training hyperparameters.
      clients_per_round: K clients sampled per round among the non-new ones (None: all).
      client_map: client-axis mapping strategy (see pfljax.core.clients).
      layers: the split layers (Lambda): indices into `unit_layers(model)`
        (forward order, negative allowed) or names such as "hidden_0", "conv_1".
      kappa: cumulative eigenvalue share fixing the number of factors.
      tau_quantile: percent of each split layer's units personalized.
      method: factor loadings, "ipf" (paper), "pca" or "eig" (released code).
      mode: "dynamic" (split every round) or "static" (once, after round 0).
      split_input: "weights" or "updates" (post-training minus start).
      split: "factor", "random" (same counts, random units) or "fixed".
      mask: ablation, "none", "shared" or "personalized" (random N(0, 1) group).
      bias_local: keep the split layers' biases fully personal (released code).
      server_lr: step on the mean update of every shared parameter.
      new_client_fraction: share of clients that never train (Sec. 3.2).
      new_client_epochs: local epochs of LocalTrain for new clients.
      max_iter, tol: bounds of the "ipf" iteration.
    """
    check_split_args(kappa, tau_quantile, method)
    for name, value, allowed in (
        ("mode", mode, MODES),
        ("split_input", split_input, SPLIT_INPUTS),
        ("split", split, SPLITS),
        ("mask", mask, MASKS),
    ):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    if not 0.0 <= new_client_fraction < 1.0:
        raise ValueError(f"new_client_fraction must be in [0, 1), got {new_client_fraction!r}")
    if new_client_epochs < 1:
        raise ValueError(f"new_client_epochs must be >= 1, got {new_client_epochs!r}")
    if max_iter < 1 or tol <= 0:
        raise ValueError(f"max_iter must be >= 1 and tol > 0, got max_iter={max_iter!r}, tol={tol!r}")
    lays = _resolve_layers(model, layers)
    cmap = as_client_map(client_map)
    loss = get_loss(local.loss)
    train = make_local_train(model.apply, local)
    template = jax.eval_shape(model.init, jax.random.key(0))
    lambda_paths = [p for lay in lays for p in (lay.kernel, lay.bias) if p]
    is_lambda = jax.tree_util.tree_map_with_path(lambda p, _: P.path_str(p) in lambda_paths, template)
    other_bytes = P.tree_bytes(P.split(template, is_lambda)[0])
    itemsize = {lay.name: np.dtype(template["params"][lay.name]["kernel"].dtype).itemsize for lay in lays}
    # tau_quantile 0 or 100 fixes the split (all shared / all personalized): no analysis needed.
    preset = split == "fixed" or tau_quantile in (0.0, 100.0)
    recompute_full_round = not preset and split == "factor" and mode == "static"

    def num_new(num: int) -> int:
        return int(round(new_client_fraction * num))

    def unit_mask(path: str, shared: dict) -> jax.Array:
        """Bool [..., units] broadcastable to the leaf `path` of one client: True = shared."""
        lay = next(lay for lay in lays if path in (lay.kernel, lay.bias))
        if path == lay.bias:
            return shared[lay.name] & (not bias_local)
        return shared[lay.name].reshape(
            (1,) * (len(template["params"][lay.name]["kernel"].shape) - 1) + (-1,)
        )

    def compose(global_params, own: dict, shared: dict) -> dict:
        """One client's Lambda leaves: shared units from the server, the rest its own."""
        server = P.flat(global_params)
        return {p: jnp.where(unit_mask(p, shared), server[p], own[p]) for p in lambda_paths}

    def ablate(leaves: dict, shared: dict, key) -> dict:
        """mask="shared"/"personalized": that group's kernel slices replaced by N(0, 1)."""
        if mask == "none":
            return leaves
        out = dict(leaves)
        for i, lay in enumerate(lays):
            noise = jax.random.normal(
                jax.random.fold_in(key, i), leaves[lay.kernel].shape, leaves[lay.kernel].dtype
            )
            group = unit_mask(lay.kernel, shared)
            out[lay.kernel] = jnp.where(group if mask == "shared" else ~group, noise, leaves[lay.kernel])
        return out

    def client_model(state: FedFacState, c, ablate_key) -> Any:
        own = take(state.client_params, c)
        leaves = ablate(
            compose(state.global_params, own, state.global_shared),
            state.global_shared,
            client_key(ablate_key, c),
        )
        return P.merge(state.global_params, leaves)

    def new_split(key, start: dict, trained: dict) -> tuple[dict, dict]:
        """The next split {layer: [units] bool}, and the analysis' factor and iteration counts."""
        out, stats = {}, {}
        for i, lay in enumerate(lays):
            if split == "factor":
                kernels = trained[lay.kernel]
                if split_input == "updates":
                    kernels = kernels - start[lay.kernel]
                res = factor_split(
                    unit_observations(kernels),
                    kappa=kappa,
                    tau_quantile=tau_quantile,
                    method=method,
                    max_iter=max_iter,
                    tol=tol,
                )
                out[lay.name] = res.shared
                stats[f"num_factors_{lay.name}"] = res.num_factors
                stats[f"fa_iterations_{lay.name}"] = res.iterations
            else:  # random
                out[lay.name] = split_by_rank(
                    jax.random.uniform(jax.random.fold_in(key, i), (lay.units,)), tau_quantile
                )
        return out, stats

    def no_new_split(state: FedFacState) -> tuple[dict, dict]:
        zero = jnp.zeros([], jnp.int32)
        stats = {f"{k}_{lay.name}": zero for lay in lays for k in ("num_factors", "fa_iterations")}
        return state.global_shared, (stats if split == "factor" else {})

    def init(key, params_template=None, num_clients: int = 1) -> FedFacState:
        params = model.init(key) if params_template is None else params_template
        _, own = P.split(params, is_lambda)
        if preset:
            shared = {
                lay.name: split_by_rank(jnp.arange(lay.units, dtype=jnp.float32), tau_quantile)
                for lay in lays
            }
        else:
            shared = {lay.name: jnp.ones((lay.units,), bool) for lay in lays}
        n_new = num_new(num_clients)
        if n_new >= num_clients:
            raise ValueError(f"new_client_fraction={new_client_fraction} leaves no client to train")
        order = jax.random.permutation(jax.random.fold_in(key, 0x4E3), num_clients)
        client_new = jnp.zeros((num_clients,), bool).at[order[:n_new]].set(True)
        return FedFacState(params, broadcast(own, num_clients), shared, client_new, jnp.zeros([], jnp.int32))

    def run_round(state: FedFacState, data: ClientData, idx, train_key, sample_key, do_split):
        ablate_key = jax.random.fold_in(sample_key, 1)

        def client_update(args):
            cid, own = args
            start = ablate(
                compose(state.global_params, own, state.global_shared),
                state.global_shared,
                client_key(ablate_key, cid),
            )
            res = train(
                P.merge(state.global_params, start), take(data.train, cid), client_key(train_key, cid)
            )
            other_new, lambda_new = P.split(res.params, is_lambda)
            return other_new, lambda_new, start, res.loss

        other_new, lambda_new, lambda_start, losses = cmap(
            client_update, (idx, gather(state.client_params, idx))
        )
        weights = data.train.count[idx].astype(jnp.float32)
        other_old, lambda_old = P.split(state.global_params, is_lambda)
        other = aggregate.server_step(other_old, aggregate.weighted_mean(other_new, weights), server_lr)

        if preset:
            shared, split_stats = no_new_split(state)
        else:
            split_key = jax.random.fold_in(sample_key, 2)
            if isinstance(do_split, bool):
                shared, split_stats = (
                    new_split(split_key, lambda_start, lambda_new) if do_split else no_new_split(state)
                )
            else:
                shared, split_stats = jax.lax.cond(
                    do_split,
                    lambda: new_split(split_key, lambda_start, lambda_new),
                    lambda: no_new_split(state),
                )
        mean_new = aggregate.weighted_mean(lambda_new, weights)
        mean_start = aggregate.weighted_mean(lambda_start, weights)
        lambda_global = {}
        for p in lambda_paths:
            # Units shared at the start all began from the server value; others from the clients' own.
            base = jnp.where(unit_mask(p, state.global_shared), lambda_old[p], mean_start[p])
            lambda_global[p] = aggregate.server_step(base, mean_new[p], server_lr)

        new_state = FedFacState(
            P.merge(state.global_params, other, lambda_global),
            scatter(state.client_params, idx, lambda_new),
            shared,
            state.client_new,
            state.round + 1,
        )
        k = idx.shape[0]
        down, up = float(other_bytes), float(other_bytes)
        full_upload = jnp.asarray(do_split & (split == "factor") & (not preset), jnp.float32)
        metrics = dict(split_stats)
        for lay in lays:
            n_old = jnp.sum(state.global_shared[lay.name]).astype(jnp.float32)
            n_new = jnp.sum(shared[lay.name]).astype(jnp.float32)
            kb, bb = (
                lay.fan_in * itemsize[lay.name],
                (0 if bias_local or lay.bias is None else itemsize[lay.name]),
            )
            down = down + n_old * (kb + bb)
            up = up + (full_upload * lay.units + (1 - full_upload) * n_new) * kb + n_new * bb
            metrics[f"shared_fraction_{lay.name}"] = n_new / lay.units
            metrics[f"unchanged_fraction_{lay.name}"] = jnp.mean(
                shared[lay.name] == state.global_shared[lay.name]
            )
        metrics["shared_fraction"] = jnp.mean(
            jnp.stack([metrics[f"shared_fraction_{lay.name}"] for lay in lays])
        )
        metrics["unchanged_fraction"] = jnp.mean(
            jnp.stack([metrics[f"unchanged_fraction_{lay.name}"] for lay in lays])
        )
        metrics.update(
            train_loss=jnp.sum(aggregate.normalized_weights(weights) * losses),
            bytes_up=jnp.asarray(k * up, jnp.float32),
            bytes_down=jnp.asarray(k * down, jnp.float32),
            participants=jnp.int32(k),
        )
        return new_state, metrics

    def round_fn(state: FedFacState, data: ClientData, key):
        num = data.train.count.shape[0]
        n_train = num - num_new(num)
        k = check_clients_per_round(clients_per_round, n_train)
        sample_key, train_key = round_keys(key, state.round)
        train_ids = jnp.nonzero(~state.client_new, size=n_train)[0]
        idx = train_ids[sample_clients(sample_key, n_train, k)]
        first = state.round == 0
        if recompute_full_round and k < n_train:
            return jax.lax.cond(
                first,
                lambda: run_round(state, data, train_ids, train_key, sample_key, True),
                lambda: run_round(state, data, idx, train_key, sample_key, False),
            )
        do_split = first if mode == "static" else True
        return run_round(state, data, idx, train_key, sample_key, do_split)

    def evaluate(state: FedFacState, data: ClientData):
        """Per-client [C]: accuracy, loss, count (new clients: their LocalTrain model),
        new_client (1.0 for new clients) and, with new clients and cross-entropy,
        ensemble_accuracy (new clients: the Ensemble rule; others: their own accuracy)."""
        num = data.test.count.shape[0]
        n_new = num_new(num)
        eval_key = jax.random.fold_in(jax.random.key(EVAL_SEED), state.round)
        ablate_key = jax.random.fold_in(eval_key, 1)

        out = evaluate_clients(
            model.apply, lambda c: client_model(state, c, ablate_key), data.test, cmap, loss
        )
        out["new_client"] = state.client_new.astype(jnp.float32)
        if n_new == 0:
            return out
        new_ids = jnp.nonzero(state.client_new, size=n_new)[0]
        train_ids = jnp.nonzero(~state.client_new, size=num - n_new)[0]
        tuned = cmap(lambda c: localtrain_scores(state, data, c, eval_key, ablate_key), new_ids)
        out = {k: v.at[new_ids].set(tuned[k]) if k in tuned else v for k, v in out.items()}
        if loss.name == "cross_entropy":
            ens = cmap(lambda c: ensemble_accuracy(state, data, c, train_ids, ablate_key), new_ids)
            out["ensemble_accuracy"] = out["accuracy"].at[new_ids].set(ens)
        return out

    def localtrain_scores(state, data, c, eval_key, ablate_key):
        """A new client's LocalTrain model: personalized units trained, all else frozen."""
        start = client_model(state, c, ablate_key)
        fixed = P.flat(start)
        trainable = {p: ~unit_mask(p, state.global_shared) for p in lambda_paths}

        def mixed(variables):
            leaves = P.flat(variables)
            for p, v in leaves.items():
                if p in trainable:
                    leaves[p] = jnp.where(trainable[p], v, fixed[p])
                elif p.startswith("params/"):
                    leaves[p] = fixed[p]
            return jax.tree.unflatten(jax.tree.structure(variables), list(leaves.values()))

        def frozen_apply(variables, x, train=False):
            return model.apply(mixed(variables), x, train)

        spec = local._replace(steps=None, epochs=new_client_epochs)
        res = make_local_train(frozen_apply, spec)(start, take(data.train, c), client_key(eval_key, c))
        return evaluate_client(model.apply, mixed(res.params), take(data.test, c), loss)

    def ensemble_accuracy(state, data, c, train_ids, ablate_key):
        """Accuracy of the mean predictive distribution of all existing clients' models."""
        test = take(data.test, c)

        def add(total, j):
            variables = client_model(state, j, ablate_key)
            logits = predict_rows(lambda xb: model.apply(variables, xb, train=False)[0], test.x)
            return total + jax.nn.softmax(logits.astype(jnp.float32), axis=-1), None

        zeros = jnp.zeros(test.y.shape + (model.num_outputs,), jnp.float32)
        probs = jax.lax.scan(add, zeros, train_ids)[0] / train_ids.shape[0]
        return scores_from_outputs(jnp.log(jnp.maximum(probs, 1e-30)), test, loss)["accuracy"]

    return Algorithm(init, round_fn, evaluate)


def final_report(state: FedFacState, fed_data, per_client: dict | None = None) -> dict:
    """Extra summary numbers: final shared fraction per layer, the generator's true
    shared fraction (simulation), and, given the final `evaluate` output
    `per_client`, existing / new clients' accuracies (LocalTrain and Ensemble)."""
    report = {f"shared_fraction_{k}": float(np.mean(np.asarray(v))) for k, v in state.global_shared.items()}
    truth = getattr(fed_data, "truth", None)
    if truth and "shared_unit_mask" in truth:
        report["true_shared_fraction"] = float(np.mean(truth["shared_unit_mask"]))
    if per_client is not None:
        new = np.asarray(per_client["new_client"]) > 0
        count = np.asarray(per_client["count"], np.float64)

        def weighted(key, rows):
            w = count[rows]
            return float(np.sum(np.asarray(per_client[key])[rows] * w) / max(w.sum(), 1.0))

        report["existing_clients_accuracy"] = weighted("accuracy", ~new)
        if new.any():
            report["new_clients_localtrain_accuracy"] = weighted("accuracy", new)
            if "ensemble_accuracy" in per_client:
                report["new_clients_ensemble_accuracy"] = weighted("ensemble_accuracy", new)
    return report
