"""FedeRiCo's Fig. 1: clients on intervals of a sine curve, each with a linear regressor.

    python -m experiments.studies.federico_sine [--clients=8] [--intervals=4] [--rounds=100] [--steps=10]
        [--plot=sine.png]

Each client holds samples of y = sin(x) + noise on its interval of [-pi, pi]
(`pfljax.data.sine`); consecutive clients share an interval when --intervals
< --clients. Every method trains a linear model (`mlp` with no hidden layer)
with Adam (lr --lr, full-batch steps) and MSE. Prints the test MSE (mean over
clients) of FedeRiCo's mixture prediction, its own models, Local and FedAvg,
and the final posterior; --plot draws the data, FedAvg's line, each client's
FedeRiCo prediction on its interval, and the posterior (the figure's right panel).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from pfljax.algorithms import fedavg, federico, local
from pfljax.core.clients import take
from pfljax.core.local import LocalTraining
from pfljax.data.sine import sine_federated_data
from pfljax.experiment.cli import parse_flags
from pfljax.models import build_model

FLAGS = flags.FLAGS
flags.DEFINE_integer("clients", 8, "clients C")
flags.DEFINE_integer("intervals", 4, "intervals of [-pi, pi] (clients share them in turn)")
flags.DEFINE_integer("samples_per_client", 50, "samples per client (80% train)")
flags.DEFINE_float("noise", 0.1, "noise standard deviation")
flags.DEFINE_integer("rounds", 100, "rounds")
flags.DEFINE_integer("steps", 10, "full-batch optimizer steps per round (FedeRiCo: M-steps)")
flags.DEFINE_float("lr", 0.05, "Adam learning rate")
flags.DEFINE_integer("seed", 0, "seed")
flags.DEFINE_string("plot", "", "PNG path for the figure (empty: no plot)")


def run(fd, mod, **kwargs):
    model = build_model("mlp", (1,), 1, hidden=())
    spec = LocalTraining(
        optax.adam(FLAGS.lr), batch_size=FLAGS.samples_per_client, steps=FLAGS.steps, loss="mse"
    )
    alg = mod.build(model, spec, **kwargs)
    state = alg.init(jax.random.key(FLAGS.seed), None, FLAGS.clients)
    rnd = jax.jit(alg.round)
    for _ in range(FLAGS.rounds):
        state, _ = rnd(state, fd.data, jax.random.key(FLAGS.seed + 1))
    return model, state, jax.device_get(jax.jit(alg.evaluate)(state, fd.data, jax.random.key(FLAGS.seed)))


def main(argv):
    del argv
    fd = sine_federated_data(
        FLAGS.clients,
        samples_per_client=FLAGS.samples_per_client,
        num_intervals=FLAGS.intervals,
        noise=FLAGS.noise,
        seed=FLAGS.seed,
    )
    results = {
        name: run(fd, mod) for name, mod in (("federico", federico), ("local", local), ("fedavg", fedavg))
    }
    mse = {name: float(-np.mean(ev["accuracy"])) for name, (_, _, ev) in results.items()}
    mse["federico_own_models"] = float(-np.mean(results["federico"][2]["own_accuracy"]))
    print("test MSE (mean over clients):", {k: round(v, 4) for k, v in mse.items()})
    post = np.asarray(results["federico"][1].client_posterior)
    print("FedeRiCo posterior (rows: clients):")
    print(np.array2string(post, precision=2, suppress_small=True))
    if FLAGS.plot:
        plot(fd, results, post, FLAGS.plot)


def plot(fd, results, post, path):
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    fig, (ax, ax_w) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    grid = jnp.linspace(-np.pi, np.pi, 200)[:, None]
    model, state, _ = results["fedavg"]
    ax.plot(grid[:, 0], model.apply(state.global_params, grid)[0][:, 0], "k:", label="FedAvg")
    model, state, _ = results["federico"]
    bounds, interval = fd.truth["bounds"], fd.truth["interval"]
    train = fd.data.train.padded()
    for c in range(train.count.shape[0]):
        n = int(train.count[c])
        ax.scatter(train.x[c, :n, 0], train.y[c, :n, 0], s=6, color=f"C{c}")
        lo, hi = bounds[interval[c]]
        xs = jnp.linspace(lo, hi, 20)[:, None]
        outs = jnp.stack([model.apply(take(state.client_params, j), xs)[0][:, 0] for j in range(len(post))])
        ax.plot(xs[:, 0], post[c] @ outs, "--", color=f"C{c}")
    ax.set(xlabel="x", ylabel="y", title="FedeRiCo (dashed) vs FedAvg (dotted)")
    ax.legend()
    ax_w.imshow(post, vmin=0, vmax=1, cmap="viridis")
    ax_w.set(xlabel="model j", ylabel="client i", title="posterior w_ij")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
