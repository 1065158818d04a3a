"""The binaries as a user meets them: every bad input is one line on stderr naming
the flag, exit code 2, no traceback; a diverging run exits 3; --help lists the
config fields; the partition command; shipped configs from any directory.

The tables run through the real binaries (`python -m experiments.main`,
`experiments.compare`, `experiments.partition`, `pfljax.experiment.*`): one warm
interpreter forks a child per case (tests/experiment/forkrun.py), so 80 cases
take seconds instead of minutes of JAX imports; three cases also run as
separate `python -m` processes (one from another directory) and must print the same.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.experiment.tiny import ROOT, TINY_FLAGS, binary_env, fork_runs, is_png

MAIN, COMPARE, PARTITION = "experiments.main", "experiments.compare", "experiments.partition"
FMNIST = ["--config=experiments/configs/default.py", "--config.dataset=fashion_mnist"]

# (binary, arguments, strings the error line must contain: the flag's name first).
# {file} is an existing file, {dir} a fresh directory.
CASES = [
    # Workdir and config file.
    (MAIN, ["--workdir={file}"], ["--workdir", "is a file"]),
    (MAIN, ["--workdir=/proc/pfljax_no/run"], ["--workdir", "writable"]),
    (MAIN, ["--config=nosuch_config.py"], ["--config=nosuch_config.py", "shipped configs", "default"]),
    (MAIN, ["--config=experiments/configs/federico_fmnist.py:permuted_9"], ["--config=", "G in (2, 3, 4)"]),
    (MAIN, ["--config=experiments/configs/pfedla_fmnist.py:noniid3_10"], ["--config=", "noniid1_10"]),
    (MAIN, ["nonsense_positional"], ["unexpected arguments", "nonsense_positional"]),
    (MAIN, ["--nosuch_flag=1"], ["nosuch_flag"]),
    (MAIN, ["--distributed=maybe"], ["--distributed"]),
    (MAIN, ["--num_processes=0"], ["--num_processes=0", ">= 1"]),
    (MAIN, ["--num_processes=2", "--process_id=2"], ["--process_id=2", "0 .. 1 (--num_processes=2)"]),
    (MAIN, ["--coordinator_address=nohost"], ["--coordinator_address=nohost", "host:port"]),
    (MAIN, ["--distributed", "--initialization_timeout=0"], ["--initialization_timeout=0", ">= 1"]),
    (MAIN, ["--distributed", "--peer_timeout=2"], ["--peer_timeout=2", ">= 5"]),
    (MAIN, ["--cpu_devices=0"], ["--cpu_devices", ">= 1", "got 0"]),
    (COMPARE, ["--distributed", "--vectorize"], ["--vectorize", "multi-process"]),
    # Fields and options that do not exist.
    (MAIN, ["--config.nosuch=1"], ["--config.nosuch=1", "not a config field", "fields: algorithm"]),
    (MAIN, ["--config.learnig_rate=0.1"], ["--config.learnig_rate", "did you mean 'learning_rate'"]),
    (MAIN, ["--config.fedfac.nosuch=1"], ["--config.fedfac.nosuch", "kappa", "tau_quantile"]),
    (MAIN, ["--config.fedper.personal_layers=2"], ["--config.fedper.personal_layers", "local_layers"]),
    (MAIN, ["--config.model_kwargs.nosuch=1"], ["--config.model_kwargs.nosuch", "hidden"]),
    (MAIN, ["--config.source.nosuch=1"], ["--config.source.nosuch", "samples_per_client"]),
    # Values of the wrong type.
    (MAIN, ["--config.rounds=abc"], ["--config.rounds=abc"]),
    (MAIN, ["--config.source.p=abc"], ["--config.source.p=abc"]),
    (MAIN, ["--config.model_kwargs.hidden=abc"], ["model_kwargs.hidden", "tuple like (200,)"]),
    (MAIN, ["--config.fedavg=1"], ["--config.fedavg=1"]),
    # Values out of range: common fields.
    (MAIN, ["--config.learning_rate=0"], ["learning_rate", "> 0", "0.0"]),
    (MAIN, ["--config.learning_rate=-0.5"], ["learning_rate", "> 0", "-0.5"]),
    (MAIN, ["--config.momentum=1.5"], ["momentum", "[0, 1)", "1.5"]),
    (MAIN, ["--config.weight_decay=-1"], ["weight_decay", ">= 0"]),
    (MAIN, ["--config.rounds=0"], ["rounds", ">= 1"]),
    (MAIN, ["--config.num_clients=0"], ["num_clients", ">= 1"]),
    (MAIN, ["--config.clients_per_round=7"], ["clients_per_round", "num_clients=6", "7"]),
    (MAIN, ["--config.local_steps=-1"], ["local_steps", ">= 0"]),
    (MAIN, ["--config.local_epochs=0"], ["local_epochs", ">= 1"]),
    (MAIN, ["--config.batch_size=0"], ["batch_size", ">= 1"]),
    (MAIN, ["--config.optimizer=lion"], ["optimizer", "'sgd'", "'lion'"]),
    (MAIN, ["--config.loss=hinge"], ["loss", "cross_entropy"]),
    (MAIN, ["--config.client_map=pmap"], ["client_map", "'vmap'"]),
    (MAIN, ["--config.chunk_size=-1"], ["chunk_size", ">= 0"]),
    (MAIN, ["--config.eval_every=0"], ["eval_every", ">= 1"]),
    (MAIN, ["--config.checkpoint_every=-1"], ["checkpoint_every", ">= 0"]),
    (MAIN, ["--config.num_devices=99"], ["num_devices", "99"]),
    (MAIN, ["--config.seed=-1"], ["seed", ">= 0"]),
    (MAIN, ["--config.data_seed=-2"], ["data_seed", ">= -1"]),
    (MAIN, ["--config.algorithm=fedavgg"], ["algorithm", "did you mean 'fedavg'"]),
    (MAIN, ["--config.model=resnet1000"], ["model", "'resnet9'"]),
    (MAIN, ["--config.model=cnn", "--config.model_kwargs.hidden=(8,)"], ["model_kwargs.hidden", "channels"]),
    (MAIN, ["--config.init_params=/nonexistent_pfljax.npz"], ["init_params", ".npz", "nonexistent_pfljax"]),
    (MAIN, ["--config.init_params={file}"], ["init_params", "cannot read a .npz"]),
    # Data fields.
    (MAIN, ["--config.partition=random"], ["partition", "'dirichlet'"]),
    (MAIN, ["--config.partition=dirichlet"], ["partition", "'iid'", "per client"]),
    (MAIN, ["--config.permute_labels=yes"], ["permute_labels", "'client'"]),
    (MAIN, ["--config.dirichlet_alpha=0"], ["dirichlet_alpha", "> 0"]),
    (MAIN, ["--config.classes_per_client=0"], ["classes_per_client", ">= 1"]),
    (MAIN, ["--config.dominant_fraction=1.5"], ["dominant_fraction", "(0, 1]"]),
    (MAIN, ["--config.num_groups=0"], ["num_groups", ">= 1"]),
    (MAIN, ["--config.samples_per_client=-5"], ["samples_per_client", ">= 0"]),
    (MAIN, ["--config.test_fraction=1.0"], ["test_fraction", "(0, 1)"]),
    (
        MAIN,
        [*FMNIST, "--config.partition=classes", "--config.classes_per_client=11"],
        ["classes_per_client", "10"],
    ),
    (MAIN, [*FMNIST, "--config.data_dir=/nonexistent_pfljax"], ["data_dir", "/nonexistent_pfljax"]),
    (MAIN, [*FMNIST, "--config.source.d=10"], ["source.d", "fashion_mnist", "standardize"]),
    (MAIN, ["--config.source.p=1.5"], ["source.p", "[0, 1]", "1.5"]),
    # Algorithm options, checked here and by the algorithms' build.
    (MAIN, ["--config.fedavg.server_lr=-1"], ["fedavg.server_lr", "> 0", "-1"]),
    (MAIN, ["--config.algorithm=fedprox", "--config.fedprox.server_lr=0"], ["fedprox.server_lr", "> 0"]),
    (MAIN, ["--config.fedavg.weighting=median"], ["fedavg.weighting", "'samples'"]),
    (MAIN, ["--config.algorithm=federico", "--config.federico.epsilon=2"], ["federico.epsilon", "[0, 1]"]),
    (MAIN, ["--config.algorithm=pfedla", "--config.pfedla.hn_lr=-1"], ["pfedla", "hn_lr", "> 0"]),
    (MAIN, ["--config.algorithm=fedfac", "--config.fedfac.kappa=0"], ["fedfac.kappa", "(0, 1]"]),
    (MAIN, ["--config.fedprox.mu=nan"], ["fedprox.mu", "> 0", "nan"]),
    # Once reported as config.fedala.eta=1.0: the option named is the one given.
    (MAIN, ["--config.algorithm=fedala", "--config.fedala.rand_percent=150"], ["fedala.rand_percent", "150"]),
    (MAIN, ["--config.dp.noise_multiplier=2"], ["dp.noise_multiplier", "dp.enabled is False"]),
    # compare.
    (COMPARE, ["--seeds=a"], ["--seeds=a", "integers"]),
    (COMPARE, ["--seeds="], ["--seeds", "empty"]),
    (COMPARE, ["--seeds=0,0"], ["--seeds=0,0", "distinct"]),
    (COMPARE, ["--algorithms=fedavg,nosuch"], ["--algorithms=fedavg,nosuch", "'nosuch'", "fedprox"]),
    (COMPARE, ["--algorithms="], ["--algorithms", "empty"]),
    (COMPARE, ["--config.learning_rate=-1"], ["learning_rate", "> 0"]),
    (COMPARE, ["--workdir={file}"], ["--workdir", "is a file"]),
    # partition.
    (PARTITION, ["--config.partition=nosuch"], ["partition", "'iid'"]),
    (PARTITION, ["--outdir={file}"], ["--outdir", "is a file"]),
]


# Runs that are not bad input: (binary, arguments, expected exit code, cwd or None for the
# repository). Their outputs are checked one by one below.
RUNS = {
    # The program of test_train's diverging run (a compilation cache hit).
    "diverges": (
        MAIN,
        ["--config.rounds=6", "--config.learning_rate=1e4", "--workdir={dir}/diverge"],
        3,
        None,
    ),
    # An argument of the run's model that the config file does not set (model_kwargs holds only hidden).
    "model_argument": (
        MAIN,
        ["--config.model=mlp_bn", "--config.model_kwargs.momentum=0.5", "--workdir={dir}/model_arg"],
        0,
        None,
    ),
    "main_help": (MAIN, ["--help"], 0, None),
    "compare_help": (COMPARE, ["--helpfull"], 0, None),
    "partition_elsewhere": ("pfljax.experiment.partition_main", ["--config=default"], 0, "{dir}"),
    # 40 samples per client, a cap of 1000 (as 1000 Fashion-MNIST clients under default.py's cap).
    "partition_cap": (PARTITION, ["--config.samples_per_client=1000"], 0, None),
    # A bare `pip install pfljax` (no experiments extra): the child cannot import HIDDEN[name].
    "run_no_matplotlib": (MAIN, ["--workdir={dir}/no_mpl"], 2, None),
    "compare_no_orbax": (COMPARE, ["--workdir={dir}/no_orbax"], 2, None),
    "partition_no_matplotlib": (PARTITION, ["--outdir={dir}/no_mpl_part"], 2, None),
}
HIDDEN = {
    "run_no_matplotlib": ["matplotlib"],
    "compare_no_orbax": ["orbax", "orbax.checkpoint"],
    "partition_no_matplotlib": ["matplotlib"],
}


def _argv(binary: str, args: list[str], tmp, index: int = 0) -> list[str]:
    """The case's command line; each case its own workdir (runs on one workdir exclude each other)."""
    base = list(TINY_FLAGS)
    if "--help" in args or "--helpfull" in args:
        return list(args)
    if binary.endswith("partition_main"):
        base = [b for b in base if not b.startswith("--config=")] + [f"--outdir={tmp}/elsewhere"]
    elif binary == PARTITION:
        base.append(f"--outdir={tmp}/part")
    else:
        base.append(f"--workdir={tmp}/run{index}")
    if binary == COMPARE:
        base += ["--algorithms=fedavg,local", "--seeds=0"]
    if any(a.startswith("--config=") for a in args) and not binary.endswith("partition_main"):
        # a case's own config replaces the tiny one
        base = [b for b in base if not b.startswith("--config")]
    args = [a.format(file=tmp / "a_file", dir=tmp) for a in args]
    out = args + base if binary.endswith("partition_main") else base + args  # --config before overrides
    if any(a.startswith(("--config.dataset=fashion_mnist", "--config.dataset=tfds:")) for a in args):
        drop = ("--config.partition=iid", "--config.source.")
        out = [a for a in out if not a.startswith(drop) or a in args]
    return out


def _env():
    return binary_env()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    (tmp / "a_file").write_text("not a directory\n")
    cases = [{"module": b, "args": _argv(b, a, tmp, i), "cwd": ROOT} for i, (b, a, _) in enumerate(CASES)]
    cases += [
        {"module": b, "args": _argv(b, a, tmp), "cwd": cwd.format(dir=tmp) if cwd else ROOT}
        | {"hide": HIDDEN.get(name, [])}
        for name, (b, a, _, cwd) in RUNS.items()
    ]
    out = fork_runs(cases)
    return tmp, cases, out[: len(CASES)], dict(zip(RUNS, out[len(CASES) :]))


def test_the_table_has_40_distinct_bad_inputs():
    keys = [(b, tuple(a)) for b, a, _ in CASES]
    assert len(set(keys)) == len(keys) >= 40


@pytest.mark.parametrize("index", range(len(CASES)), ids=[" ".join(a)[:60] for _, a, _ in CASES])
def test_bad_input_is_one_line_naming_the_flag_and_exit_2(results, index):
    _, cases, out, _ = results
    binary, args, needles = CASES[index]
    res = out[index]
    lines = res["stderr"].strip().splitlines()
    context = f"{binary} {' '.join(cases[index]['args'])}\nstderr: {res['stderr'][-1500:]}"
    assert res["rc"] == 2, context
    assert len(lines) == 1 and lines[0].startswith("error: "), context
    assert "Traceback" not in res["stderr"] and "\\n" not in lines[0] and "\"'" not in lines[0], context
    assert len(lines[0]) < 1200, context
    for needle in needles:
        assert needle in lines[0], (needle, context)
    assert not os.path.exists(os.path.join(results[0], f"run{index}"))  # nothing written, no empty workdir


def _run(results, name):
    res = results[3][name]
    assert res["rc"] == RUNS[name][2], res["stderr"][-3000:]
    return res


def test_a_diverging_run_exits_3_with_one_error_line(results):
    res = _run(results, "diverges")
    errors = [line for line in res["stderr"].splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0] == res["stderr"].strip().splitlines()[-1]
    assert errors[0].startswith("error: fedavg diverged at round ") and " of 6 (" in errors[0]
    assert "learning_rate=10000" in errors[0] and "try --config.learning_rate=1000" in errors[0]
    summary = json.load(open(os.path.join(results[0], "diverge", "summary.json")))
    assert summary["status"] == "diverged" and f"at round {summary['diverged_round']} of 6" in errors[0]


def test_a_model_argument_the_config_does_not_set_is_given_on_the_command_line(results):
    _run(results, "model_argument")
    config = json.load(open(os.path.join(results[0], "model_arg", "config.json")))
    assert config["model"] == "mlp_bn" and config["model_kwargs"] == {"hidden": [8], "momentum": 0.5}


def test_help_lists_the_config_fields_and_algorithm_options(results):
    for name in ("main_help", "compare_help"):
        text = _run(results, name)["stdout"]
        assert (
            "Config fields" in text and "  learning_rate=None  -- > 0; unset: the optimizer's default" in text
        )
        assert "  fedfac: " in text and "tau_quantile=50.0" in text and "Shipped configs" in text
        assert "Exit codes: 0 completed, 2 bad input, 3 a run diverged, 4 out of device memory, " in text
        assert "130 / 143 interrupted by SIGINT / SIGTERM." in text
        (dp,) = [line for line in text.splitlines() if line.startswith("  dp.<option>=value")]
        assert "enabled=False" in dp and "noise_multiplier=1.0" in dp and "ConfigDict" not in text
    assert "pfljax-run" in results[3]["main_help"]["stdout"]
    assert "--algorithms" in results[3]["compare_help"]["stdout"]


@pytest.mark.parametrize(
    "name, package",
    [
        ("run_no_matplotlib", "matplotlib"),
        ("compare_no_orbax", "orbax-checkpoint"),
        ("partition_no_matplotlib", "matplotlib"),
    ],
)
def test_without_the_experiments_extra_one_line_exit_2_nothing_written(results, name, package):
    res = _run(results, name)
    assert res["stderr"].strip().splitlines() == [
        f"error: missing package {package} (the binaries need the experiments extra): "
        "pip install 'pfljax[experiments]' (in a clone: pip install -e '.[experiments]')"
    ]
    written = {
        "run_no_matplotlib": "no_mpl",
        "compare_no_orbax": "no_orbax",
        "partition_no_matplotlib": "no_mpl_part",
    }
    assert not os.path.exists(os.path.join(results[0], written[name]))


def test_a_missing_package_is_found_without_importing_it(monkeypatch):
    from pfljax.experiment import cli

    assert not cli.missing_package("tensorboardX") and cli.missing_package("pfljax_no_such_pkg")
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    assert cli.missing_package("tensorboardX")
    with pytest.raises(SystemExit) as exit_info:
        cli.require_packages(cli.RUN_PACKAGES)
    assert exit_info.value.code == 2


def test_partition_command_from_another_directory_with_a_shipped_config(results):
    res = _run(results, "partition_elsewhere")
    outdir = os.path.join(results[0], "elsewhere")
    data = json.load(open(os.path.join(outdir, "data.json")))
    assert is_png(os.path.join(outdir, "partition.png"))
    lines = res["stdout"].splitlines()
    assert lines[0] == "simulation, 6 clients, per-client generator (seed 0)"
    assert lines[1].split()[:3] == ["client", "train", "test"] and lines[2].split() == ["0", "1"]  # classes
    table = [[int(v) for v in line.split()] for line in lines[3:9]]  # the printed table is data.json's
    assert table == [[c["client"], c["train"], c["test"], *c["train_class_counts"]] for c in data["clients"]]


def test_partition_says_when_no_client_reaches_the_cap(results):
    res = _run(results, "partition_cap")
    (warning,) = [line for line in res["stderr"].splitlines() if "is a cap" in line]
    assert warning.endswith(
        "config.samples_per_client=1000 is a cap, and no client reaches it: 240 samples over 6 clients "
        "give 40..40 (mean 40) samples per client"
    )
    assert (
        res["stdout"].splitlines()[-2]
        == "total: 192 train, 48 test samples over 6 clients (40..40 per client)"
    )


@pytest.mark.parametrize("index", [2, len(CASES) - 9])
def test_forked_runs_print_what_a_fresh_interpreter_prints(results, index):
    tmp, cases, out, _ = results
    proc = subprocess.run(
        [sys.executable, "-m", cases[index]["module"], *cases[index]["args"]],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(),
        timeout=600,
    )
    assert (proc.returncode, proc.stderr) == (out[index]["rc"], out[index]["stderr"])


def test_installed_binaries_run_from_any_directory(tmp_path):
    """As after `pip install`: another working directory, pfljax on the path, a
    shipped config by name."""
    env = dict(_env(), PYTHONPATH=ROOT)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pfljax.experiment.main",
            "--config=federico_fmnist:permuted_9",
            "--workdir=w",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error: --config=")
    assert (
        "pfljax/experiment/configs/federico_fmnist.py:permuted_9: ValueError: config argument" in proc.stderr
    )


def test_out_of_device_memory_is_one_line_and_exit_4(tmp_path, capsys):
    import jax

    from pfljax.experiment.cli import EXIT_OUT_OF_MEMORY, out_of_memory_exits

    kept = tmp_path / "metrics.jsonl"
    with pytest.raises(SystemExit) as exit_info, out_of_memory_exits(str(tmp_path)):
        kept.write_text('{"round": 1}\n')
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 5.88GiB with allocator GPU_0_bfc\n"
            "second line of XLA's message"
        )
    assert exit_info.value.code == EXIT_OUT_OF_MEMORY == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: out of device memory: RESOURCE_EXHAUSTED")
    assert "5.88GiB" in err[0] and "second line" not in err[0] and "--config.client_map=map" in err[0]
    assert kept.read_text() == '{"round": 1}\n'  # what was written stays
    with pytest.raises(jax.errors.JaxRuntimeError), out_of_memory_exits(str(tmp_path)):
        raise jax.errors.JaxRuntimeError("INTERNAL: some other failure")  # not memory: a bug, as before


EXPERIMENT_BINARIES = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts)
    for path in pathlib.Path(ROOT, "experiments").rglob("*.py")
    if "app.run(" in path.read_text()
)


def test_every_experiment_binary_refuses_a_bad_flag_in_one_line_with_exit_2():
    cases = [{"module": m, "args": ["--no_such_flag_pfljax=1"], "cwd": ROOT} for m in EXPERIMENT_BINARIES]
    cases.append({"module": "experiments.bench.bench_vs_torch", "args": ["--conv_impl=nosuch"], "cwd": ROOT})
    assert len(EXPERIMENT_BINARIES) >= 20
    for case, res in zip(cases, fork_runs(cases)):
        lines = res["stderr"].strip().splitlines()
        context = f"{case}\nstderr: {res['stderr'][-1500:]}"
        assert res["rc"] == 2 and len(lines) == 1 and lines[0].startswith("error: "), context
        assert case["args"][0].split("=")[0].lstrip("-") in lines[0], context


def test_conv_impl_onednn_where_it_cannot_be_built_is_one_line_and_exit_2(tmp_path):
    """A compiler that fails (CXX=false) and an empty cache: the benchmarks asked for
    --conv_impl=onednn refuse in one line, exit 2, before anything runs."""
    env = {**binary_env(), "CXX": "false", "PFLJAX_CACHE_DIR": str(tmp_path)}
    for module, args in [
        ("experiments.bench.bench", ["--conv_impl=onednn", "--cases=cnn"]),
        ("experiments.bench.bench_vs_torch", ["--conv_impl=im2col,onednn", "--cases=cnn"]),
        ("experiments.bench.profile_round", ["--conv_impl=onednn"]),
    ]:
        res = subprocess.run(
            [sys.executable, "-m", module, *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and "conv_impl" in lines[0], (
            module,
            res.stderr[-1500:],
        )
        assert "libdnnl-dev" in lines[0] and not res.stdout.strip(), (module, res.stdout[-500:])


def test_bench_vs_torch_without_torch_is_one_line_and_exit_2():
    """torch blocked (None in sys.modules, as if not installed): one line naming it, exit 2."""
    code = (
        "import runpy, sys; sys.modules['torch'] = None; "
        "sys.argv = ['bench_vs_torch', '--cases=mlp']; "
        "runpy.run_module('experiments.bench.bench_vs_torch', run_name='__main__')"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=binary_env(), capture_output=True, text=True, timeout=300
    )
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "torch" in lines[0], res.stderr[-1500:]
    assert ".[bench]" in lines[0] and not res.stdout.strip()
