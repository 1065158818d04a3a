"""Several runs of one algorithm as one compiled program: `train_replicas(configs, workdirs)`.

The runs (replicas, `pfljax.core.replicas`) differ only by `seed` and by the
values of grid options (`grid`: the top-level `learning_rate` or a float option
of the algorithm); they share the federated data, so every config must give the
same partition (`data_seed` >= 0, or one seed). Each replica writes what
`train_and_evaluate` writes into its own workdir (config.json, data.json,
partition.png, metrics.jsonl / .csv, traces.jsonl, tensorboard/, summary.json,
accuracy.png, loss.png, collaboration.png) with the same numbers (up to float
summation order, rtol ~1e-5). The whole replica state is checkpointed in
`checkpoint_dir` (not in each run's `checkpoints/`); rerunning resumes from it.

Not supported (ConfigError before training): more than one device
(`num_devices`), `dp.target_epsilon` (runs stopping at different rounds), a
workdir holding a run that this sweep's checkpoint does not cover.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from pfljax import algorithms
from pfljax.core import replicas as R
from pfljax.experiment import plots
from pfljax.experiment.checkpoint import Checkpoints, check_config
from pfljax.experiment.config import (
    ConfigError,
    _tuples,
    dp_delta,
    make_client_map,
    make_local,
    make_privacy,
    prepare,
    to_plain,
)
from pfljax.experiment.outputs import JsonlLog, TensorBoard, jsonable, write_csv, write_json
from pfljax.experiment.train import (
    EVAL_STREAM,
    STATUS_COMPLETED,
    STATUS_DIVERGED,
    _non_finite,
    _optional_reports,
    _plots,
    _summary,
    all_finite,
    best_window_mean,
    check_workdir,
    data_title,
    divergence_message,
    eval_key,
    evaluation_row,
    privacy_epsilon,
    split_metrics,
)

TOP_LEVEL = ("learning_rate",)  # top-level fields a grid may vary (they enter through make_local)
RUN_FILES = ("metrics.jsonl", "summary.json", "checkpoints")


class _Override:
    """A config view with some fields replaced (by traced values)."""

    def __init__(self, base, **fields):
        self._base, self._fields = base, fields

    def __getattr__(self, name):
        return self._fields[name] if name in self._fields else getattr(self._base, name)


def grid_target(config, option: str) -> str:
    """'' for a top-level field, else the algorithm whose numeric option `option` is; ConfigError otherwise.

    Any scalar option with a declared domain (`pfljax.algorithms.domains`) may be a
    grid's. As one program (`train_replicas`) only float options can vary: an
    integer option is refused there (`make_build`), and whether a float option's
    build path traces is tried (`pfljax.core.replicas.check_varying`).
    """
    if option in TOP_LEVEL:
        return ""
    name = config.algorithm
    options = config[name] if name in config else {}
    domains, value = algorithms.domains(name), options.get(option)
    if option in domains and isinstance(value, int | float) and not isinstance(value, bool):
        return name
    if option in options:
        raise ConfigError(
            f"--grid={option}: config.{name}.{option}={value!r} is not a number; "
            "it cannot vary inside one program"
        )
    floats = sorted(k for k, d in domains.items() if not d.integer and isinstance(options.get(k), float))
    raise ConfigError(
        f"--grid={option}: not a float option of {name} nor one of {list(TOP_LEVEL)}; "
        f"{name}'s float options: {floats}"
    )


def make_build(config, prep, grid_names: Sequence[str]):
    """build(**{option: scalar}) -> the Algorithm of `config` with those options replaced.

    ConfigError for an integer option (`pfljax.algorithms.domains`): a grid's value is
    a traced float scalar, which a count or a shape cannot be.
    """
    name = config.algorithm
    domains = algorithms.domains(name)
    for option in grid_names:
        if option not in TOP_LEVEL and domains[option].integer:
            raise ConfigError(
                f"--grid={option}: config.{name}.{option} is an integer option: it cannot vary inside one "
                "program (its values are traced floats); run them as separate runs (without --vectorize)"
            )
    options = _tuples(to_plain(config[name])) if name in config else {}
    privacy = make_privacy(config)
    if privacy is not None:
        options["privacy"] = privacy
    cmap = make_client_map(config)

    def build(**hyper):
        top = {k: v for k, v in hyper.items() if k in TOP_LEVEL}
        local = make_local(_Override(config, **top), prep.fed_data.task)
        opts = {**options, **{k: v for k, v in hyper.items() if k not in TOP_LEVEL}}
        return algorithms.get(name).build(
            prep.model, local, clients_per_round=config.clients_per_round or None, client_map=cmap, **opts
        )

    return build


def _check_inputs(configs, workdirs, grid_names):
    first = configs[0]
    ignore = {"seed", "rounds", "eval_every", "checkpoint_every", *grid_names}
    base = {k: v for k, v in _flat(to_plain(first)).items() if k.split(".")[-1] not in ignore}
    for c in configs[1:]:
        other = {k: v for k, v in _flat(to_plain(c)).items() if k.split(".")[-1] not in ignore}
        if other != base:
            differ = sorted(k for k in set(base) | set(other) if base.get(k) != other.get(k))
            raise ConfigError(
                f"replicas must differ only by seed and {list(grid_names)}; they differ in {differ}"
            )
        for field in ("rounds", "eval_every", "checkpoint_every"):
            if c[field] != first[field]:
                raise ConfigError(f"replicas must share config.{field}")
    seeds = {c.seed for c in configs}
    if len(seeds) > 1 and first.data_seed < 0:
        raise ConfigError(
            f"--vectorize runs seeds {sorted(seeds)} on one shared partition, but config.data_seed=-1 "
            "gives each seed its own: set --config.data_seed=<n> (>= 0), or run without --vectorize"
        )
    if first.num_devices not in (0, 1):
        raise ConfigError(f"--vectorize runs on one device; got config.num_devices={first.num_devices}")
    if first.dp.enabled and first.dp.target_epsilon:
        raise ConfigError("--vectorize does not support config.dp.target_epsilon (runs would stop apart)")
    if len(set(map(os.path.abspath, workdirs))) != len(workdirs):
        raise ConfigError("replicas need distinct workdirs")


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "model_kwargs":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def train_replicas(
    configs: Sequence,
    workdirs: Sequence[str],
    *,
    fed_data=None,
    grid: Sequence[str] = (),
    checkpoint_dir: str,
    memory_limit: int | None = None,
    dry_run: bool = False,
    strategy: str = "auto",
) -> list[dict] | None:
    """Runs (or resumes) the configs as replicas of one program; returns their summaries.

    Args:
      configs: one ConfigDict per replica, differing only by `seed` and the `grid` options.
      workdirs: one output directory per replica (as train_and_evaluate's).
      fed_data: the shared FederatedData (built from configs[0] if None).
      grid: names of the options whose values vary (traced scalars).
      checkpoint_dir: where the whole replica state is checkpointed.
      memory_limit: bytes available (default: the device's, see replicas.device_memory_bytes).
      dry_run: only the checks (nothing trained or written); returns None.
      strategy: how the replicas are mapped ("vmap", "map" or "auto": map on CPU,
        see `pfljax.core.replicas.resolve_strategy`).

    Raises:
      ConfigError: before training, for configs that cannot run as one program
        (an option that cannot vary, different partitions, too many replicas for
        the memory, a workdir holding another run).
    """
    t_start = time.perf_counter()
    try:
        R.resolve_strategy(strategy)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if len(configs) != len(workdirs) or not configs:
        raise ConfigError("give one workdir per config, at least one")
    for w in workdirs:
        check_workdir(w)
    preps = [prepare(c, fed_data) for c in configs]  # validates every value concretely
    fed_data = preps[0].fed_data
    rconfigs = [p.config for p in preps]
    grid = list(grid)
    for option in grid:
        for c in rconfigs:
            grid_target(c, option)
    _check_inputs(rconfigs, workdirs, grid)
    config, prep = rconfigs[0], preps[0]
    count = len(configs)
    num = fed_data.data.train.count.shape[0]
    if grid:
        values = {o: [_option(c, o) for c in rconfigs] for o in grid}
        build = make_build(config, prep, grid)
        try:
            R.check_varying(build, values, fed_data.data, num, prefix=f"{config.algorithm} option ")
        except ValueError as e:
            raise ConfigError(str(e)) from e
        reps = R.replicate_grid(build, values, strategy)
    else:
        reps = R.replicate(prep.algorithm, count, strategy)
    keys = [jax.random.split(jax.random.key(c.seed)) for c in rconfigs]
    init_keys, run_keys = jnp.stack([k[0] for k in keys]), jnp.stack([k[1] for k in keys])
    one = jax.eval_shape(lambda k: prep.algorithm.init(k, None, num), init_keys[0])
    try:
        R.check_memory(one, fed_data.data, count, memory_limit, what=f"{config.algorithm} replicas")
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if not os.path.isdir(checkpoint_dir):
        for w in workdirs:
            held = [f for f in RUN_FILES if os.path.exists(os.path.join(w, f))]
            if held:
                raise ConfigError(
                    f"--workdir {w!r} holds a run ({', '.join(held)}) and there is no replica checkpoint "
                    f"{checkpoint_dir!r}: --vectorize cannot resume it; use another --workdir or run "
                    "without --vectorize"
                )
    if dry_run:
        return None

    plains = [to_plain(c) for c in rconfigs]
    template = jax.device_get(jax.jit(lambda k: reps.init(k, None, num))(init_keys))
    ckpts = Checkpoints(checkpoint_dir)
    try:
        start = ckpts.latest() or 0
        if start:
            saved = ckpts.restore_host(start)
            if len(saved["configs"]) != count:
                raise ConfigError(
                    f"{checkpoint_dir!r} holds a checkpoint of {len(saved['configs'])} replicas, not {count}"
                )
            for s, p, w in zip(saved["configs"], plains, workdirs):
                check_config(s, p, w)
            if config.rounds < start:
                raise ConfigError(f"config.rounds={config.rounds} is below round {start} of the checkpoint")
            states, saved = ckpts.restore(start, template)
            hosts = saved["replicas"]
        else:
            states = template
            hosts = [
                {
                    "bytes_up_total": 0.0,
                    "bytes_down_total": 0.0,
                    "best_mean_accuracy": None,
                    "round_seconds": [],
                    "diverged": None,
                }
                for _ in range(count)
            ]
        return _loop(rconfigs, preps, plains, workdirs, reps, states, hosts, start, run_keys, ckpts, t_start)
    finally:
        ckpts.close()


def _option(config, option):
    return float(config[option] if option in TOP_LEVEL else config[config.algorithm][option])


def _loop(configs, preps, plains, workdirs, reps, states, hosts, start, run_keys, ckpts, t_start):
    config, prep, count = configs[0], preps[0], len(configs)
    for line in prep.notes:
        logging.info("%s", line)
    metrics_logs = [JsonlLog(os.path.join(w, "metrics.jsonl")) for w in workdirs]
    traces_logs = [JsonlLog(os.path.join(w, "traces.jsonl")) for w in workdirs]
    rows = [log.truncate(start) for log in metrics_logs]
    tbs = []
    for r, w in enumerate(workdirs):
        traces_logs[r].truncate(start)
        write_csv(os.path.join(w, "metrics.csv"), rows[r])
        write_json(os.path.join(w, "config.json"), plains[r])
        write_json(os.path.join(w, "data.json"), prep.fed_data.summary)
        plots.plot_partition(prep.fed_data.summary, os.path.join(w, "partition.png"), data_title(configs[r]))
        tbs.append(TensorBoard(os.path.join(w, "tensorboard"), purge_step=start + 1 if start else None))

    data = prep.fed_data.data
    t0 = time.perf_counter()

    def checked_round(states, data, keys):
        states, metrics = reps.round(states, data, keys)
        return states, metrics, jax.vmap(all_finite)(states)

    round_fn = jax.jit(checked_round, donate_argnums=0).lower(states, data, run_keys).compile()
    eval_bases = jax.vmap(lambda k: jax.random.fold_in(k, EVAL_STREAM))(run_keys)
    eval_fn = jax.jit(reps.evaluate).lower(states, data, eval_bases).compile()
    compile_seconds = time.perf_counter() - t0
    logging.info(
        "%s: %d replicas, rounds %d..%d as one program, compiled in %.1f s",
        config.algorithm,
        count,
        start + 1,
        config.rounds,
        compile_seconds,
    )
    eval_keys = lambda r: jax.vmap(lambda k: eval_key(k, r))(eval_bases)  # noqa: E731
    per_client = [None] * count
    for rnd in range(start + 1, config.rounds + 1):
        t0 = time.perf_counter()
        states, metrics, finite = round_fn(states, data, run_keys)
        metrics, finite = jax.device_get((metrics, finite))
        seconds = time.perf_counter() - t0
        evaluate = rnd % config.eval_every == 0 or rnd == config.rounds
        ev = None
        if evaluate:
            t1 = time.perf_counter()
            ev = jax.device_get(eval_fn(states, data, eval_keys(rnd)))
            eval_seconds = time.perf_counter() - t1
        for r in range(count):
            host = hosts[r]
            if host["diverged"] is not None:
                continue
            scalars, traces = split_metrics(R.take(metrics, r))
            loss = scalars.get("train_loss")
            what = _non_finite(loss, bool(finite[r]))
            if what:
                host["diverged"] = {"round": rnd, "train_loss": str(loss), "what": what}
                continue
            host["round_seconds"].append(seconds)
            host["bytes_up_total"] += scalars.get("bytes_up", 0.0)
            host["bytes_down_total"] += scalars.get("bytes_down", 0.0)
            if traces:
                traces_logs[r].append({"round": rnd, **traces})
            if ev is None:
                continue
            pc = R.take(ev, r)
            what = _non_finite(None, True, pc)
            if what:
                host["diverged"] = {"round": rnd, "train_loss": str(loss), "what": what}
                continue
            per_client[r] = pc
            row = {"round": rnd, **scalars, **evaluation_row(pc), "seconds": seconds}
            eps = privacy_epsilon(configs[r], rnd)
            if eps is not None:
                row["dp_epsilon"] = eps
            row["eval_seconds"] = eval_seconds
            best = host["best_mean_accuracy"]
            host["best_mean_accuracy"] = (
                row["mean_accuracy"] if best is None else max(best, row["mean_accuracy"])
            )
            rows[r].append(jsonable(row))
            metrics_logs[r].append(row)
            write_csv(os.path.join(workdirs[r], "metrics.csv"), rows[r])
            tbs[r].scalars(rnd, {k: v for k, v in jsonable(row).items() if k != "round"})
        if ev is not None:
            done = [h for h in hosts if h["diverged"] is None]
            logging.info(
                "%s round %d/%d: mean acc over %d running replicas %.4f, %.3f s/round",
                config.algorithm,
                rnd,
                config.rounds,
                len(done),
                np.mean(
                    [rows[r][-1]["mean_accuracy"] for r in range(count) if hosts[r]["diverged"] is None]
                    or [np.nan]
                ),
                seconds,
            )
        if (config.checkpoint_every and rnd % config.checkpoint_every == 0) or rnd == config.rounds:
            ckpts.save(rnd, jax.device_get(states), {"replicas": hosts, "configs": plains})
        if all(h["diverged"] is not None for h in hosts):
            break
    for tb in tbs:
        tb.close()

    final_keys = jax.device_get(eval_keys(config.rounds))
    if any(p is None for p, h in zip(per_client, hosts) if h["diverged"] is None):  # resumed at the end
        ev = jax.device_get(eval_fn(states, data, eval_keys(config.rounds)))
        per_client = [R.take(ev, r) if p is None else p for r, p in enumerate(per_client)]
    host_states = jax.device_get(states)
    summaries = []
    for r in range(count):
        c, p, host, w = configs[r], preps[r], hosts[r], workdirs[r]
        d = host["diverged"]
        if d is not None:
            summary = _summary(c, p, host, None, compile_seconds, t_start)
            summary.update(
                status=STATUS_DIVERGED,
                diverged_round=d["round"],
                diverged_train_loss=d["train_loss"],
                divergence=divergence_message(c, d["round"], d["what"], w),
                last_evaluation=rows[r][-1] if rows[r] else None,
            )
        else:
            summary = _summary(c, p, host, per_client[r], compile_seconds, t_start)
            report_prep = p._replace(algorithm=reps.algorithm(r))
            summary.update(
                _optional_reports(report_prep, R.take(host_states, r), per_client[r], R.take(final_keys, r))
            )
        summary["best_mean_10_accuracy"] = best_window_mean([row["mean_accuracy"] for row in rows[r]])
        if c.dp.enabled:
            rounds_run = summary.get("diverged_round", c.rounds + 1) - 1
            summary.update(
                dp_epsilon=privacy_epsilon(c, min(rounds_run, c.rounds)),
                dp_delta=dp_delta(c),
                dp_noise_multiplier=c.dp.noise_multiplier,
                dp_clip_norm=c.dp.clip_norm,
            )
        summary["replicas"] = count
        _plots(w, rows[r], summary, c)
        write_json(os.path.join(w, "summary.json"), summary)
        summaries.append(jsonable(summary))
    assert STATUS_COMPLETED  # the default status of _summary
    return summaries
