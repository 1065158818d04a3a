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
  sampled clients only, and also reports a majority vote). The key given to
  `evaluate` draws the LocalTrain batches (client c: client_key(key, c)) and the
  mask-ablation values (client_key(fold_in(key, 1), c)).

Paper vs released code (paper is the default, the code an option):
- Factor analysis: iterated principal-axis factoring ("ipf") vs the code's
  `FactorAnalyzer` (minres: the same least-squares fit, reached by another
  iteration) or, with `--direct_eigDecom`, raw eigenvectors (method="eig",
  which also keeps G - 1 factors as the code). "ipf" starts, by default, from
  squared multiple correlations, as FactorAnalyzer (and psych, SPSS) do, and
  runs to convergence, so it reaches FactorAnalyzer's solution;
  `ipf_start="pca"` is the paper's start (sqrt(g_m) u_m), which can end at
  another stationary point (see `pfljax.core.factor`). Each analysis reports
  `fa_iterations_<layer>`, `fa_change_<layer>` (the last communality change)
  and `fa_converged_<layer>` (1.0 or 0.0) in the round's metrics.
- Threshold: exact rank split (tau_quantile=100 personalizes every unit) vs the
  code's `nu < percentile(nu, q)`; the code's default "mean" threshold is not
  offered.
- Bias: a unit's bias entry goes with the unit (paper); `bias_local=True` keeps
  the split layer's whole bias personal, as the code does.
- The code has no server learning rate (server_lr=1.0 is the code).

The round is `pfljax.core.round.federated_round` with the non-new clients
eligible; in static mode with partial participation round 0 is a second round
(every eligible client, the split computed) chosen by `lax.cond`.

State: `global_params` is the full variables tree (server values; for Lambda
layers the shared units' averages), `client_params` {path: [C, ...]} each client's
own Lambda kernels and biases, `global_shared` {layer: [units] bool} the current
split, `client_new` [C] bool the clients that never train.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pfljax.core import aggregate, factor
from pfljax.core import params as P
from pfljax.core.clients import ClientMap, as_client_map, broadcast, client_key, take
from pfljax.core.domains import SERVER_LR, Domain, checked
from pfljax.core.evaluate import evaluate_client, evaluate_clients, predict_rows, scores_from_outputs
from pfljax.core.factor import (
    SOLVERS,
    STARTS,
    FactorSplit,
    factor_split,
    split_by_rank,
    unit_observations,
)
from pfljax.core.layers import param_order
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.losses import Loss, get_loss
from pfljax.core.round import Participants, client_step, federated_round
from pfljax.core.sampling import check_clients_per_round
from pfljax.core.types import Algorithm, ClientData
from pfljax.models.base import Model

__all__ = ["FactorSplit", "FedFacState", "build", "factor_split", "final_report", "unit_layers"]

MODES = ("static", "dynamic")
SPLIT_INPUTS = ("weights", "updates")
SPLITS = ("factor", "random", "fixed")
MASKS = ("none", "shared", "personalized")


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
    ndim: int  # kernel rank
    itemsize: int  # kernel bytes per entry


class FedFacHyper(NamedTuple):
    """What FedFac's pieces need: `build`'s options (same names) and what follows
    from the model: the split layers, their leaf paths, the rest's bytes, the
    local trainers and the loss."""

    mode: str
    split: str
    split_input: str
    mask: str
    bias_local: bool
    server_lr: float
    kappa: float
    tau_quantile: float
    method: str
    max_iter: int
    tol: float
    ipf_start: str
    ipf_solver: str
    new_client_fraction: float
    new_client_epochs: int
    layers: tuple  # of _Layer (Lambda)
    lambda_paths: tuple  # the split layers' kernel and bias paths
    is_lambda: Any  # bool tree: True on lambda_paths
    preset: bool  # the split is fixed at init: no analysis
    other_bytes: int  # bytes of every leaf outside Lambda
    train: Callable  # local training of a round
    tune: LocalTraining  # new clients' LocalTrain schedule
    apply: Callable
    num_outputs: int
    loss: Loss
    client_map: Callable


def unit_layers(model: Model) -> list[str]:
    """Names of the model's layers with a `kernel` leaf, in forward order."""
    template = model.template()["params"]
    names = [k for k, v in template.items() if isinstance(v, dict) and "kernel" in v]
    if model.module is None:
        return sorted(names)
    return [n for n in param_order(model) if n in names]


def resolve_layers(model: Model, layers: Sequence[int | str]) -> tuple[_Layer, ...]:
    """The split layers named by `build`'s `layers` (indices or names of `unit_layers`)."""
    names = unit_layers(model)
    if isinstance(layers, (int, str)) or len(layers) == 0:
        raise ValueError(f"layers must be a non-empty tuple of indices or names from {names}, got {layers!r}")
    template = model.template()["params"]
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
        kernel = template[name]["kernel"]
        out.append(
            _Layer(
                name=name,
                kernel=f"params/{name}/kernel",
                bias=f"params/{name}/bias" if "bias" in template[name] else None,
                units=kernel.shape[-1],
                fan_in=math.prod(kernel.shape[:-1]),
                ndim=len(kernel.shape),
                itemsize=np.dtype(kernel.dtype).itemsize,
            )
        )
    return tuple(out)


def check_options(*, method, mode, split_input, split, mask, ipf_start, ipf_solver, **_) -> None:
    """ValueError naming the first option that is none of its choices (numbers: `DOMAINS`)."""
    for name, value, allowed in (
        ("method", method, factor.METHODS),
        ("ipf_start", ipf_start, STARTS),
        ("ipf_solver", ipf_solver, SOLVERS),
        ("mode", mode, MODES),
        ("split_input", split_input, SPLIT_INPUTS),
        ("split", split, SPLITS),
        ("mask", mask, MASKS),
    ):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def hyper(model: Model, local: LocalTraining, client_map, layers, **options) -> FedFacHyper:
    """Validates `build`'s options and derives the rest of FedFacHyper."""
    check_options(**options)
    lays = resolve_layers(model, layers)
    template = model.template()
    paths = tuple(p for lay in lays for p in (lay.kernel, lay.bias) if p)
    is_lambda = jax.tree_util.tree_map_with_path(lambda p, _: P.path_str(p) in paths, template)
    return FedFacHyper(
        **options,
        layers=lays,
        lambda_paths=paths,
        is_lambda=is_lambda,
        # tau_quantile 0 or 100 fixes the split (all shared / all personalized): no analysis needed.
        preset=options["split"] == "fixed" or options["tau_quantile"] in (0.0, 100.0),
        other_bytes=P.tree_bytes(P.split(template, is_lambda)[0]),
        train=make_local_train(model.apply, local),
        tune=local._replace(steps=None, epochs=options["new_client_epochs"]),
        apply=model.apply,
        num_outputs=model.num_outputs,
        loss=get_loss(local.loss),
        client_map=as_client_map(client_map),
    )


def num_new(hp: FedFacHyper, num: int) -> int:
    """How many of `num` clients are new (never train)."""
    return int(round(hp.new_client_fraction * num))


def eligible(hp: FedFacHyper, state: FedFacState, num: int) -> tuple[jax.Array, int]:
    """The clients a round may sample: every non-new one (ids [n], n static)."""
    n = num - num_new(hp, num)
    return jnp.nonzero(~state.client_new, size=n)[0], n


def unit_mask(hp: FedFacHyper, path: str, shared: dict) -> jax.Array:
    """Bool [..., units] broadcastable to the leaf `path` of one client: True = shared."""
    lay = next(lay for lay in hp.layers if path in (lay.kernel, lay.bias))
    if path == lay.bias:
        return shared[lay.name] & (not hp.bias_local)
    return shared[lay.name].reshape((1,) * (lay.ndim - 1) + (-1,))


def compose(hp: FedFacHyper, global_params, own: dict, shared: dict) -> dict:
    """One client's Lambda leaves: shared units from the server, the rest its own."""
    server = P.flat(global_params)
    return {p: jnp.where(unit_mask(hp, p, shared), server[p], own[p]) for p in hp.lambda_paths}


def ablate(hp: FedFacHyper, leaves: dict, shared: dict, key) -> dict:
    """mask="shared"/"personalized": that group's kernel slices replaced by N(0, 1)."""
    if hp.mask == "none":
        return leaves
    out = dict(leaves)
    for i, lay in enumerate(hp.layers):
        kernel = leaves[lay.kernel]
        noise = jax.random.normal(jax.random.fold_in(key, i), kernel.shape, kernel.dtype)
        group = unit_mask(hp, lay.kernel, shared)
        out[lay.kernel] = jnp.where(group if hp.mask == "shared" else ~group, noise, kernel)
    return out


def handed_out(hp: FedFacHyper, state: FedFacState, own: dict, key) -> dict:
    """The Lambda leaves a client gets from the server (composed, then ablated with `key`)."""
    return ablate(hp, compose(hp, state.global_params, own, state.global_shared), state.global_shared, key)


def client_model(hp: FedFacHyper, state: FedFacState, c, ablate_key) -> Any:
    """Client c's full variables (ablation noise from client_key(ablate_key, c))."""
    own = take(state.client_params, c)
    return P.merge(state.global_params, handed_out(hp, state, own, client_key(ablate_key, c)))


def new_split(hp: FedFacHyper, key, start: dict, trained: dict) -> tuple[dict, dict]:
    """The next split {layer: [units] bool}, and the analysis' factor and iteration counts."""
    out, stats = {}, {}
    for i, lay in enumerate(hp.layers):
        if hp.split == "factor":
            kernels = trained[lay.kernel]
            if hp.split_input == "updates":
                kernels = kernels - start[lay.kernel]
            res = factor_split(
                unit_observations(kernels),
                kappa=hp.kappa,
                tau_quantile=hp.tau_quantile,
                method=hp.method,
                max_iter=hp.max_iter,
                tol=hp.tol,
                start=hp.ipf_start,
                solver=hp.ipf_solver,
            )
            out[lay.name] = res.shared
            stats[f"num_factors_{lay.name}"] = res.num_factors
            stats[f"fa_iterations_{lay.name}"] = res.iterations
            stats[f"fa_change_{lay.name}"] = res.change.astype(jnp.float32)
            stats[f"fa_converged_{lay.name}"] = res.converged.astype(jnp.float32)
        else:  # random
            out[lay.name] = split_by_rank(
                jax.random.uniform(jax.random.fold_in(key, i), (lay.units,)), hp.tau_quantile
            )
    return out, stats


def no_new_split(hp: FedFacHyper, state: FedFacState) -> tuple[dict, dict]:
    """The current split, with zero analysis counts (no analysis: nothing to converge)."""
    stats = {}
    for lay in hp.layers:
        stats[f"num_factors_{lay.name}"] = jnp.zeros([], jnp.int32)
        stats[f"fa_iterations_{lay.name}"] = jnp.zeros([], jnp.int32)
        stats[f"fa_change_{lay.name}"] = jnp.zeros([], jnp.float32)
        stats[f"fa_converged_{lay.name}"] = jnp.ones([], jnp.float32)
    return state.global_shared, (stats if hp.split == "factor" else {})


def next_split(hp: FedFacHyper, do_split, state: FedFacState, key, start: dict, trained: dict):
    """`new_split` or `no_new_split`: by `do_split` (a bool, or traced: lax.cond)."""
    if hp.preset:
        return no_new_split(hp, state)
    if isinstance(do_split, bool):
        return new_split(hp, key, start, trained) if do_split else no_new_split(hp, state)
    return jax.lax.cond(do_split, lambda: new_split(hp, key, start, trained), lambda: no_new_split(hp, state))


def split_metrics(hp: FedFacHyper, old: dict, new: dict, full_upload, k: int) -> dict:
    """Shared / unchanged fractions and bytes: down, the old split's shared units;
    up, the new split's (every kernel slice when the factor analysis needs them)."""
    down, up = float(hp.other_bytes), float(hp.other_bytes)
    full = jnp.asarray(full_upload, jnp.float32)
    metrics = {}
    for lay in hp.layers:
        n_old = jnp.sum(old[lay.name]).astype(jnp.float32)
        n_new = jnp.sum(new[lay.name]).astype(jnp.float32)
        kb, bb = lay.fan_in * lay.itemsize, (0 if hp.bias_local or lay.bias is None else lay.itemsize)
        down = down + n_old * (kb + bb)
        up = up + (full * lay.units + (1 - full) * n_new) * kb + n_new * bb
        metrics[f"shared_fraction_{lay.name}"] = n_new / lay.units
        metrics[f"unchanged_fraction_{lay.name}"] = jnp.mean(new[lay.name] == old[lay.name])
    for name in ("shared_fraction", "unchanged_fraction"):
        metrics[name] = jnp.mean(jnp.stack([metrics[f"{name}_{lay.name}"] for lay in hp.layers]))
    metrics["bytes_up"] = jnp.asarray(k * up, jnp.float32)
    metrics["bytes_down"] = jnp.asarray(k * down, jnp.float32)
    return metrics


def init(hp: FedFacHyper, model: Model, key, params_template=None, num_clients: int = 1) -> FedFacState:
    """Every client starts from the same model; the initial split (all shared, or the
    preset one); the new clients, a random set of round(new_client_fraction * C)."""
    params = model.initial(key, params_template)
    _, own = P.split(params, hp.is_lambda)
    if hp.preset:
        ranks = {lay.name: jnp.arange(lay.units, dtype=jnp.float32) for lay in hp.layers}
        shared = {name: split_by_rank(r, hp.tau_quantile) for name, r in ranks.items()}
    else:
        shared = {lay.name: jnp.ones((lay.units,), bool) for lay in hp.layers}
    n_new = num_new(hp, num_clients)
    if n_new >= num_clients:
        raise ValueError(f"new_client_fraction={hp.new_client_fraction} leaves no client to train")
    order = jax.random.permutation(jax.random.fold_in(key, 0x4E3), num_clients)
    client_new = jnp.zeros((num_clients,), bool).at[order[:n_new]].set(True)
    return FedFacState(params, broadcast(own, num_clients), shared, client_new, jnp.zeros([], jnp.int32))


def client_inputs(state: FedFacState, part: Participants):
    """What a participant brings: its own Lambda leaves and its ablation key."""
    ablate_key = jax.random.fold_in(part.sample_key, 1)
    return part.gather(state.client_params), jax.vmap(lambda c: client_key(ablate_key, c))(part.ids)


def client_update(hp: FedFacHyper, state: FedFacState, cid, inputs, data, key):
    """ONE client: the handed-out model trained locally; returns (other leaves,
    Lambda leaves, Lambda leaves at the start) and the loss."""
    own, ablate_key = inputs
    start = handed_out(hp, state, own, ablate_key)
    res = hp.train(P.merge(state.global_params, start), data, key)
    other_new, lambda_new = P.split(res.params, hp.is_lambda)
    return (other_new, lambda_new, start), res.loss


def server_update(hp: FedFacHyper, do_split, state: FedFacState, outputs, part: Participants):
    """Weighted means with a server step (a shared unit's base: the server value, a
    personalized one's: the mean start), clients' Lambda leaves stored, the next
    split. `do_split`: True, False or None (split in round 0 only)."""
    other_new, lambda_new, lambda_start = outputs
    other_old, lambda_old = P.split(state.global_params, hp.is_lambda)
    other = aggregate.server_step(other_old, part.mean(other_new), hp.server_lr)
    do_split = state.round == 0 if do_split is None else do_split
    split_key = jax.random.fold_in(part.sample_key, 2)
    shared, split_stats = next_split(hp, do_split, state, split_key, lambda_start, lambda_new)
    mean_new, mean_start = part.mean(lambda_new), part.mean(lambda_start)
    lambda_global = {}
    for p in hp.lambda_paths:
        # Units shared at the start all began from the server value; others from the clients' own.
        base = jnp.where(unit_mask(hp, p, state.global_shared), lambda_old[p], mean_start[p])
        lambda_global[p] = aggregate.server_step(base, mean_new[p], hp.server_lr)
    new_state = state._replace(
        global_params=P.merge(state.global_params, other, lambda_global),
        client_params=part.scatter(state.client_params, lambda_new),
        global_shared=shared,
    )
    full_upload = do_split & (hp.split == "factor") & (not hp.preset)
    return new_state, {**split_stats, **split_metrics(hp, state.global_shared, shared, full_upload, part.k)}


def make_round(hp: FedFacHyper, clients_per_round: int | None) -> Callable:
    """The round. Dynamic: a new split every round. Static: the split after round 0,
    which, for a factor split under partial participation, takes every eligible client."""

    def with_split(k, do_split):
        step = client_step(
            functools.partial(client_update, hp),
            functools.partial(server_update, hp, do_split),
            hp.client_map,
            client_inputs,
        )
        return federated_round(step, clients_per_round=k, eligible=functools.partial(eligible, hp))

    if hp.mode == "dynamic":
        return with_split(clients_per_round, True)
    static = with_split(clients_per_round, None)
    if hp.preset or hp.split != "factor":
        return static
    warm_up, later = with_split(None, True), with_split(clients_per_round, False)

    def round_fn(state: FedFacState, data: ClientData, key):
        n = data.train.count.shape[0] - num_new(hp, data.train.count.shape[0])
        if check_clients_per_round(clients_per_round, n) == n:
            return static(state, data, key)
        return jax.lax.cond(state.round == 0, warm_up, later, state, data, key)

    return round_fn


def freeze(fixed: dict, trainable: dict, variables) -> Any:
    """`variables` with "params" leaves reset to `fixed` except where `trainable`
    (a {path: bool mask} of Lambda leaves); other collections kept."""
    leaves = P.flat(variables)
    for p, v in leaves.items():
        if p in trainable:
            leaves[p] = jnp.where(trainable[p], v, fixed[p])
        elif p.startswith("params/"):
            leaves[p] = fixed[p]
    return jax.tree.unflatten(jax.tree.structure(variables), list(leaves.values()))


def localtrain_scores(hp: FedFacHyper, state: FedFacState, data: ClientData, c, eval_key, ablate_key) -> dict:
    """A new client's LocalTrain model: personalized units trained, all else frozen."""
    start = client_model(hp, state, c, ablate_key)
    trainable = {p: ~unit_mask(hp, p, state.global_shared) for p in hp.lambda_paths}
    mixed = functools.partial(freeze, P.flat(start), trainable)

    def frozen_apply(variables, x, train=False):
        return hp.apply(mixed(variables), x, train)

    res = make_local_train(frozen_apply, hp.tune)(start, take(data.train, c), client_key(eval_key, c))
    return evaluate_client(hp.apply, mixed(res.params), take(data.test, c), hp.loss)


def ensemble_accuracy(hp: FedFacHyper, state: FedFacState, data: ClientData, c, train_ids, ablate_key):
    """Accuracy of the mean predictive distribution of all existing clients' models."""
    test = take(data.test, c)

    def add(total, j):
        variables = client_model(hp, state, j, ablate_key)
        logits = predict_rows(lambda xb: hp.apply(variables, xb, train=False)[0], test.x)
        return total + jax.nn.softmax(logits.astype(jnp.float32), axis=-1), None

    zeros = jnp.zeros(test.y.shape + (hp.num_outputs,), jnp.float32)
    probs = jax.lax.scan(add, zeros, train_ids)[0] / train_ids.shape[0]
    return scores_from_outputs(jnp.log(jnp.maximum(probs, 1e-30)), test, hp.loss)["accuracy"]


def evaluate(hp: FedFacHyper, state: FedFacState, data: ClientData, key):
    """Per-client [C]: accuracy, loss, count (new clients: their LocalTrain model, batches
    from `key`), new_client (1.0 for new clients) and, with new clients and cross-entropy,
    ensemble_accuracy (new clients: the Ensemble rule; others: their own accuracy).
    Mask ablation draws from fold_in(key, 1)."""
    num = data.test.count.shape[0]
    n_new = num_new(hp, num)
    ablate_key = jax.random.fold_in(key, 1)
    cmap = hp.client_map
    out = evaluate_clients(
        hp.apply, lambda c: client_model(hp, state, c, ablate_key), data.test, cmap, hp.loss
    )
    out["new_client"] = state.client_new.astype(jnp.float32)
    if n_new == 0:
        return out
    new_ids = jnp.nonzero(state.client_new, size=n_new)[0]
    train_ids = jnp.nonzero(~state.client_new, size=num - n_new)[0]
    tuned = cmap(lambda c: localtrain_scores(hp, state, data, c, key, ablate_key), new_ids)
    out = {k: v.at[new_ids].set(tuned[k]) if k in tuned else v for k, v in out.items()}
    if hp.loss.name == "cross_entropy":
        ens = cmap(lambda c: ensemble_accuracy(hp, state, data, c, train_ids, ablate_key), new_ids)
        out["ensemble_accuracy"] = out["accuracy"].at[new_ids].set(ens)
    return out


def final_report(state: FedFacState, fed_data, per_client: dict | None = None, key=None) -> dict:
    """Extra summary numbers: final shared fraction per layer, the generator's true
    shared fraction (simulation), and, given the final `evaluate` output
    `per_client`, existing / new clients' accuracies (LocalTrain and Ensemble)."""
    del key  # the report needs no randomness
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


# Why the clients cannot live in host memory (pfljax.runtime.offload).
HOST_STORAGE_REFUSED = (
    "it samples among the non-new clients only, and under partial "
    "participation its first round trains every eligible client"
)

DOMAINS = {
    **factor.DOMAINS,
    "server_lr": SERVER_LR,
    "new_client_fraction": Domain(0, 1, high_open=True),
    "new_client_epochs": Domain(1, integer=True),
    "layers": Domain(integer=True, note="indices into unit_layers(model), or layer names"),
}


@checked(DOMAINS)
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
    max_iter: int = 500,
    tol: float = 1e-6,
    ipf_start: str = "smc",
    ipf_solver: str = "lbfgs",
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
      max_iter, tol: bounds of the "ipf" iteration (principal-axis solves;
        communality change).
      ipf_start: "ipf" starting communalities: "smc" (standard, as the released
        code's FactorAnalyzer) or "pca" (the paper's sqrt(g_m) u_m).
      ipf_solver: "ipf" steps: "lbfgs" (quasi-Newton) or "plain" (textbook).
    """
    hp = hyper(
        model, local, client_map, layers,
        mode=mode, split=split, split_input=split_input, mask=mask, bias_local=bias_local,
        server_lr=server_lr, kappa=kappa, tau_quantile=tau_quantile, method=method, max_iter=max_iter,
        tol=tol, new_client_fraction=new_client_fraction, new_client_epochs=new_client_epochs,
        ipf_start=ipf_start, ipf_solver=ipf_solver,
    )  # fmt: skip
    return Algorithm(
        functools.partial(init, hp, model),
        make_round(hp, clients_per_round),
        functools.partial(evaluate, hp),
        final_report=final_report,
    )
