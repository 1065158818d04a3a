"""Local training of ONE client (a loop over optimizer steps) and THE batch schedule.

Minibatches are sampled inside jit from the client's own rows: every epoch is a
fresh random permutation of its `count` real rows (padding never sampled), cut
into ceil(count / B) batches, the last one partial (its missing slots carry
weight 0); with `drop_last` (torch's DataLoader(drop_last=True), PFLlib's) into
floor(count / B) full batches, the rows left over sitting out that epoch (a
client of fewer than B rows takes no step). Two schedules:

- `steps=S`: every client takes S steps, cycling through epochs;
- `epochs=E`: client c takes E * ceil(count_c / B) steps (E * floor(count_c / B)
  with drop_last); the scan runs the static maximum E * ceil(n_max / B) (floor
  with drop_last) and later steps are no-ops (skipped, not zero-gradient steps,
  so momentum and weight decay do not move either).

`schedule_position` says where step s falls (epoch, batch, active) and is the one
definition of the schedule: `make_local_train` follows it with the epoch order
carried in its loop (`next_batch`); `step_batch` gives step s's rows without a carry,
and `batch_schedule` all S steps' rows at once, for local loops that are not
`make_local_train` (Per-FedAvg, pFedMe, FedeRiCo's M-steps).

`run_steps` runs the steps, as `LocalTraining.loop` says: "scan" (the static
maximum, inactive steps masked) or "while" (only the client's own `own_steps`,
so a round's compute follows the clients' real sizes under `lax.map`; under
`vmap` a batch runs its largest client's count). Same numbers either way, and the
"while" loop's derivatives (`jax.grad`, `jax.jvp`) are the scan's (tested).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pfljax.core.domains import known_zero
from pfljax.core.losses import Loss, get_loss, masked_mean
from pfljax.core.types import ClientArrays

Params = Any
LOOPS = ("auto", "scan", "while")


class LocalTraining(NamedTuple):
    """Hyperparameters of local training, shared by every algorithm.

    Attributes:
      optimizer: optax transformation for client updates. Its state starts afresh
        (`optimizer.init`) at every round's local training, as in FedAvg and PFLlib (a
        new optimizer per round), unless the algorithm keeps it in its state (FedeRiCo
        keeps every model's, as its paper's Adam does).
      batch_size: minibatch size B.
      steps: local steps per round (exclusive with epochs).
      epochs: local epochs per round (exclusive with steps; if neither is
        given, one epoch).
      loss: "cross_entropy" (classification) or "mse" (regression), or a Loss.
      loop: "while" (each client runs only its own steps), "scan" (the static
        maximum, masked) or "auto" (while on CPU, scan on GPU/TPU where a
        while loop's trip test costs a device round trip). Same numbers, and the same
        derivatives: `jax.grad` through a round (e.g. with respect to a learning rate)
        differentiates the "while" loop as the masked scan.
      drop_last: epochs of floor(count / B) full batches, the last partial batch
        dropped (torch's drop_last=True, PFLlib's train loader); default False:
        ceil(count / B) batches, the last one partial.
    """

    optimizer: optax.GradientTransformation
    batch_size: int = 32
    steps: int | None = None
    epochs: int | None = None
    loss: str | Loss = "cross_entropy"
    loop: str = "auto"
    drop_last: bool = False

    def validate(self) -> LocalTraining:
        if self.steps is not None and self.epochs is not None:
            raise ValueError(
                f"give exactly one of local steps or local epochs, got steps={self.steps}, "
                f"epochs={self.epochs}"
            )
        if self.steps is None and self.epochs is None:
            return self._replace(epochs=1).validate()
        for name in ("steps", "epochs"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"local {name} must be >= 1, got {value}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.loop not in LOOPS:
            raise ValueError(f"local loop must be one of {LOOPS}, got {self.loop!r}")
        if not isinstance(self.drop_last, bool):
            raise ValueError(f"drop_last must be True or False, got {self.drop_last!r}")
        get_loss(self.loss)
        return self

    def resolved_loop(self) -> str:
        """ "while" or "scan" ("auto": while on CPU)."""
        if self.loop == "auto":
            return "while" if jax.default_backend() == "cpu" else "scan"
        return self.loop


class LocalResult(NamedTuple):
    """params: trained variables; opt_state: final optimizer state; loss: mean batch loss."""

    params: Params
    opt_state: Any
    loss: jax.Array


def shuffled_rows(key: jax.Array, count: jax.Array, n_max: int) -> jax.Array:
    """A permutation [n_max] of row indices: a random order of the `count` real
    rows first, then the padded rows."""
    noise = jax.random.uniform(key, (n_max,))
    return jnp.argsort(jnp.where(jnp.arange(n_max) < count, noise, 2.0))


def epoch_order(key: jax.Array, epoch: jax.Array, count: jax.Array, n_max: int, batch_size: int) -> jax.Array:
    """Row order of one epoch [n_max + B]: its first `count` entries are a random
    permutation of the real rows; the B trailing entries pad the last batch."""
    perm = shuffled_rows(jax.random.fold_in(key, epoch), count, n_max)
    return jnp.concatenate([perm, jnp.zeros((batch_size,), perm.dtype)])


def batch_rows(order: jax.Array, j: jax.Array, count: jax.Array, batch_size: int):
    """Rows [B] of batch j of an epoch order, and their weights (0 past `count`).

    The slots of a partial last batch are filled with real rows again (wrapping
    around the epoch order) and weigh 0: padded rows never enter the forward
    pass, so they cannot reach BatchNorm statistics either.
    """
    pos = j * batch_size + jnp.arange(batch_size)
    weights = (pos < count).astype(jnp.float32)
    pos = jnp.where(pos < count, pos, pos % jnp.maximum(count, 1))
    return order[pos], weights


def batches_per_epoch(count: jax.Array, batch_size: int, drop_last: bool = False) -> jax.Array:
    """ceil(count / B), at least 1; with drop_last floor(count / B), 0 below B rows
    (int32 scalar)."""
    if drop_last:
        return count // batch_size
    return jnp.maximum((count + batch_size - 1) // batch_size, 1)


def _trains(spec: LocalTraining, count: jax.Array) -> jax.Array:
    """Whether a client of `count` rows takes any step: count > 0, and with
    drop_last count >= B (one full batch)."""
    return count >= (spec.batch_size if spec.drop_last else 1)


def schedule_position(spec: LocalTraining, s: jax.Array, count: jax.Array):
    """(epoch, batch within the epoch, active) of local step s of a client with
    `count` rows. Inactive steps (an empty client, a client of fewer than B rows
    with drop_last, or past E epochs) are no-ops."""
    per_epoch = jnp.maximum(batches_per_epoch(count, spec.batch_size, spec.drop_last), 1)
    epoch = s // per_epoch
    active = _trains(spec, count)
    if spec.epochs is not None:
        active &= epoch < spec.epochs
    return epoch, s % per_epoch, active


# Row indices per client up to which `epoch_orders` draws every epoch's order before the steps.
MAX_PLANNED_ROWS = 1 << 16


def epoch_orders(spec: LocalTraining, key: jax.Array, count: jax.Array, n_max: int) -> jax.Array | None:
    """Every epoch's row order [E, n_max + B] of one client, drawn before its steps, when the
    schedule has a static number of epochs E (`spec.epochs`) and E * (n_max + B) <=
    MAX_PLANNED_ROWS; else None (orders are then drawn during the steps). The same orders as
    `epoch_order`; drawn once, they keep a sort of n_max rows out of every step where a
    per-step branch would run both sides (under vmap)."""
    epochs = spec.validate().epochs
    if epochs is None or epochs * (n_max + spec.batch_size) > MAX_PLANNED_ROWS:
        return None
    return jax.vmap(lambda e: epoch_order(key, e, count, n_max, spec.batch_size))(jnp.arange(epochs))


def step_batch(spec: LocalTraining, key: jax.Array, s: jax.Array, count: jax.Array, n_max: int, orders=None):
    """Rows [B], weights [B] and activity of local step s (0, 1, 2, ... across epochs)
    of one client, as `make_local_train` would draw them with the same key; `orders`:
    `epoch_orders(spec, key, count, n_max)` (None: this step's epoch order is drawn here).
    With `orders`, a step past the E epochs (inactive) gets the last epoch's rows: a caller
    that uses batches beyond E epochs (Per-FedAvg's) passes None."""
    epoch, j, active = schedule_position(spec, s, count)
    if orders is None:
        order = epoch_order(key, epoch, count, n_max, spec.batch_size)
    else:
        order = orders[jnp.minimum(epoch, orders.shape[0] - 1)]
    rows, weights = batch_rows(order, j, count, spec.batch_size)
    return rows, weights, active


def next_batch(spec: LocalTraining, key: jax.Array, s: jax.Array, count: jax.Array, n_max: int, order):
    """(order, rows [B], weights [B], active) of local step s, given the epoch order
    [n_max + B] of step s - 1 (`epoch_order(key, 0, ...)` before step 0): a new order
    only at epoch starts (a real branch under lax.map). Same rows as `step_batch`."""
    epoch, j, active = schedule_position(spec, s, count)
    order = jax.lax.cond(
        (j == 0) & (s > 0),
        lambda: epoch_order(key, epoch, count, n_max, spec.batch_size),
        lambda: order,
    )
    rows, weights = batch_rows(order, j, count, spec.batch_size)
    return order, rows, weights, active


def first_order(spec: LocalTraining, key: jax.Array, count: jax.Array, n_max: int, orders) -> jax.Array:
    """The order a loop over `local_batch` carries into step 0: epoch 0's when `orders` is
    None, else a placeholder (the orders are drawn already)."""
    return epoch_order(key, 0, count, n_max, spec.batch_size) if orders is None else jnp.int32(0)


def local_batch(spec: LocalTraining, key, s, count, n_max: int, orders, order):
    """(order, rows [B], weights [B], active) of local step s of a loop carrying `order`: from
    `orders` (`epoch_orders`, drawn before the steps) where given, else `next_batch`. The batch
    lookup of `make_local_train` and of the methods' own local loops."""
    if orders is None:
        return next_batch(spec, key, s, count, n_max, order)
    return (order, *step_batch(spec, key, s, count, n_max, orders))


def batch_schedule(spec: LocalTraining, key: jax.Array, count: jax.Array, n_max: int, steps: int):
    """Rows [S, B], weights [S, B] and activity [S] of local steps 0..S-1 of one client
    (`step_batch` of each s, with one epoch order per epoch instead of one per step)."""

    def body(order, s):
        order, rows, weights, active = next_batch(spec, key, s, count, n_max, order)
        return order, (rows, weights, active)

    order0 = epoch_order(key, 0, count, n_max, spec.batch_size)
    return jax.lax.scan(body, order0, jnp.arange(steps))[1]


def own_steps(spec: LocalTraining, count: jax.Array) -> jax.Array:
    """The number of active local steps of a client with `count` rows: S, or
    E * ceil(count / B) (E * floor(count / B) with drop_last); 0 for a client that
    takes no step (empty, or fewer than B rows with drop_last)."""
    per_epoch = batches_per_epoch(count, spec.batch_size, spec.drop_last)
    total = spec.steps if spec.steps is not None else spec.epochs * per_epoch
    return jnp.where(_trains(spec, count), total, 0).astype(jnp.int32)


def run_steps(spec: LocalTraining, count: jax.Array, n_max: int, body: Callable, carry: Any):
    """Runs local steps s = 0, 1, ... of one client: `body(carry, s) -> (carry, loss,
    active)`, where inactive steps must leave the carry unchanged (as with
    `schedule_position`'s flag). Returns (carry, mean loss over the active steps).

    "scan" runs num_scan_steps(spec, n_max) steps; "while" only own_steps(count).
    """
    spec = spec.validate()

    def step(c, s):
        inner, loss_sum, n_active = c
        inner, loss, active = body(inner, s)
        return (inner, loss_sum + loss * active, n_active + active.astype(jnp.int32)), None

    init = (carry, jnp.float32(0.0), jnp.int32(0))
    num_steps = num_scan_steps(spec, n_max)
    if spec.resolved_loop() == "scan":
        out = jax.lax.scan(step, init, jnp.arange(num_steps))[0]
    else:
        out = _while_with_scan_derivatives(step, init, own_steps(spec, count), num_steps)
    carry, loss_sum, n_active = out
    return carry, loss_sum / jnp.maximum(n_active, 1)


def _while_with_scan_derivatives(step: Callable, init: Any, last: jax.Array, num_steps: int):
    """`step` over s = 0 .. last - 1 in a while loop; its derivatives (forward and reverse
    mode, e.g. `jax.grad` through a round) are those of the scan over all `num_steps`, which
    gives the same values because steps past `last` are inactive (they leave the carry
    unchanged). Every value `step` closes over becomes an explicit argument, so that
    derivatives with respect to them (a learning rate, the data) flow too and the scan's
    rule, traced when a transformation differentiates the loop, closes over no tracer."""
    step_jaxpr, out_shape = jax.make_jaxpr(step, return_shape=True)(init, jnp.int32(0))
    constants = step_jaxpr.consts

    def explicit_step(carry, s, *constants):
        out = jax.core.eval_jaxpr(step_jaxpr.jaxpr, constants, *jax.tree.leaves((carry, s)))
        return jax.tree.unflatten(jax.tree.structure(out_shape), out)

    @jax.custom_jvp
    def loop(init, last, *constants):
        def body(c):
            return c[0] + 1, explicit_step(c[1], c[0], *constants)[0]

        return jax.lax.while_loop(lambda c: c[0] < last, body, (jnp.int32(0), init))[1]

    @loop.defjvp
    def scan_derivatives(primals, tangents):
        def scanned(init, last, *constants):
            return jax.lax.scan(lambda c, s: explicit_step(c, s, *constants), init, jnp.arange(num_steps))[0]

        return jax.jvp(scanned, primals, tangents)

    return loop(init, last, *constants)


def num_scan_steps(spec: LocalTraining, n_max: int) -> int:
    """Static length of the local scan for clients padded to n_max rows."""
    spec = spec.validate()
    if spec.steps is not None:
        return spec.steps
    per_epoch = n_max // spec.batch_size if spec.drop_last else -(-n_max // spec.batch_size)
    return spec.epochs * max(per_epoch, 1)


def make_local_train(
    apply_fn: Callable,
    spec: LocalTraining,
    *,
    prox_mu: float = 0.0,
    regularizer: Callable[[Params], jax.Array] | None = None,
) -> Callable[..., LocalResult]:
    """Builds `train(variables, data, key, anchor=None, opt_state=None) -> LocalResult`.

    Args:
      apply_fn: model apply, (variables, x, train) -> (out, updates).
      spec: LocalTraining hyperparameters.
      prox_mu: FedProx proximal weight: adds prox_mu / 2 * ||p - anchor||^2 over
        the "params" collection (anchor defaults to the starting variables).
      regularizer: extra loss term on the "params" collection (e.g. an L1 penalty).

    The returned `train` works on ONE client: data is a ClientArrays whose
    leaves have no client axis (x [n_max, ...], y [n_max], count []).
    """
    spec = spec.validate()
    loss_obj = get_loss(spec.loss)
    optimizer = spec.optimizer

    def objective(params, rest, anchor, xb, yb, wb):
        out, updates = apply_fn({**rest, "params": params}, xb, train=True)
        loss = masked_mean(loss_obj.per_example(out, yb), wb)
        total = loss
        if not known_zero(prox_mu):  # a traced prox_mu (a grid's) is kept
            sq = jax.tree.map(lambda p, a: jnp.sum((p - a) ** 2), params, anchor)
            total = total + 0.5 * prox_mu * sum(jax.tree.leaves(sq))
        if regularizer is not None:
            total = total + regularizer(params)
        return total, (loss, updates)

    grad_fn = jax.grad(objective, has_aux=True)

    def train(variables, data: ClientArrays, key, anchor=None, opt_state=None) -> LocalResult:
        n_max = data.x.shape[0]
        params = variables["params"]
        rest = {k: v for k, v in variables.items() if k != "params"}
        anchor_params = params if anchor is None else anchor["params"]
        if opt_state is None:
            opt_state = optimizer.init(params)

        orders = epoch_orders(spec, key, data.count, n_max)

        def step(carry, s):
            params, rest, opt_state, order = carry
            order, rows, weights, active = local_batch(spec, key, s, data.count, n_max, orders, order)
            xb, yb = data.x[rows], data.y[rows]
            grads, (loss, updates) = grad_fn(params, rest, anchor_params, xb, yb, weights)
            upd, new_opt = optimizer.update(grads, opt_state, params)
            new = (optax.apply_updates(params, upd), {**rest, **updates}, new_opt)
            kept = jax.tree.map(lambda a, b: jnp.where(active, a, b), new, (params, rest, opt_state))
            return (*kept, order), loss, active

        order0 = first_order(spec, key, data.count, n_max, orders)
        (params, rest, opt_state, _), mean_loss = run_steps(
            spec, data.count, n_max, step, (params, rest, opt_state, order0)
        )
        return LocalResult({**rest, "params": params}, opt_state, mean_loss)

    return train
