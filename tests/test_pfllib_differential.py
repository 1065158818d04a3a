"""experiments/pfllib/pfllib_differential.py on a synthetic PFLlib log and pfljax workdir: the
per-round table pairs PFLlib's evaluation r with pfljax's round r and gives the
difference in seed-spread units."""

import json
import subprocess
import sys

from tests.experiment.tiny import ROOT, binary_env

ROUND = """-------------Round number: {r}-------------

Evaluate global model
Averaged Train Loss: {loss}
Averaged Test Accuracy: {acc}
Averaged Test AUC: 0.6487
------------------------- time cost ------------------------- 10.5
"""


def in_subprocess(expression: str, path) -> object:
    """json of `expression` (names from experiments.pfllib.pfllib_differential, sys.argv[1] = path) in a
    fresh interpreter: the driver's absl flags cannot share a pytest worker with another driver's."""
    code = (
        "import json, sys; from experiments.pfllib.pfllib_differential import METHODS, parse_pfllib_log; "
        f"print(json.dumps({expression}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=ROOT, env=binary_env(),
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def write_pfljax_run(directory, accs, loss: float) -> None:
    """A pfljax seed directory: metrics.jsonl with `accs` after rounds 1, 2, ... (2 s a round)."""
    directory.mkdir(parents=True)
    rows = [
        {"round": r + 1, "mean_accuracy": a, "mean_loss": loss, "seconds": 2.0} for r, a in enumerate(accs)
    ]
    (directory / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def run_differential(logs, work, *flags: str) -> str:
    """The driver's stdout on PFLlib logs `logs` and the pfljax workdir `work` ("mine"), seeds 0 and 1."""
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.pfllib.pfllib_differential", f"--pfllib_logs={logs}",
         f"--pfljax=mine={work}", "--seeds=0,1", *flags],  # fmt: skip
        capture_output=True, text=True, cwd=ROOT, env=binary_env(), timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_round_table_pairs_pfllib_evaluation_r_with_pfljax_round_r(tmp_path):
    logs, work = tmp_path / "logs", tmp_path / "pfljax"
    logs.mkdir()
    pfllib = {0: [0.1, 0.3, 0.5], 1: [0.1, 0.5, 0.7]}  # evaluations 0, 1, 2
    for s, accs in pfllib.items():
        text = "".join(ROUND.format(r=r, loss=2.0 - r / 10, acc=a) for r, a in enumerate(accs))
        (logs / f"pfllib_FedAvg_seed{s}.log").write_text(text + "Average time cost: 31.5s.\n")
    for s, accs in {0: [0.4, 0.6], 1: [0.4, 0.6]}.items():  # rounds 1, 2
        write_pfljax_run(work / "fedavg" / f"seed_{s}", accs, 1.9)
    out = run_differential(logs, work)
    # Round 1: PFLlib 40 +- 10, pfljax 40 +- 0 -> 0 units; round 2: 60 +- 10 vs 60 +- 0.
    assert "| 1 | 40.00 +- 10.00 | 40.00 +- 0.00 | +0.00 |" in out, out
    assert "| 2 | 60.00 +- 10.00 | 60.00 +- 0.00 | +0.00 |" in out, out
    # Loss: PFLlib's train loss after round 1 is 1.9 on both seeds, pfljax's 1.9: no spread.
    assert "| 1 | 1.900 +- 0.000 | 1.900 +- 0.000 | +nan |" in out, out
    # Best over rounds 1..2: PFLlib 60 +- 10 (0.5 and 0.7), pfljax 60 +- 0.
    assert "| FedAvg | PFLlib | 2 | 2 | 40.00 +- 10.00 | 60.00 +- 10.00 |  |" in out, out
    # A rerun of a seed linked as seed 7 joins PFLlib's side only: round 1 of 30, 50, 60.
    rerun = "".join(ROUND.format(r=r, loss=1.0, acc=a) for r, a in enumerate([0.1, 0.6, 0.9]))
    (logs / "pfllib_FedAvg_seed7.log").write_text(rerun + "Average time cost: 31.5s.\n")
    out = run_differential(logs, work, "--pfllib_seeds=0,1,7")
    # 46.67 +- 12.47 against 40 +- 0: (40 - 46.67) / sqrt(12.47^2 / 2) = -0.76 units.
    assert "| 1 | 46.67 +- 12.47 | 40.00 +- 0.00 | -0.76 |" in out, out
    assert "| FedAvg | PFLlib | 3 | 2 | 46.67 +- 12.47 |" in out, out
    assert "| FedAvg | pfljax (mine) | 2 | 2 |" in out, out


def test_fedcp_log_personal_accuracy_and_its_dashed_round_seconds(tmp_path):
    text = (
        "-------------Round number: 0-------------\n\nEvaluate before local training\n"
        "Averaged Test Accuracy: 0.0584\nAveraged Test AUC: 0.5\n"
        + "-" * 50 + " 93.25\n"
        "-------------Round number: 1-------------\n\nEvaluate before local training\n"
        "Averaged Test Accuracy: 0.7012\n"
    )  # fmt: skip
    path = tmp_path / "pfllib_FedCP_seed0.log"
    path.write_text(text)
    out = in_subprocess("parse_pfllib_log(sys.argv[1])", path)
    assert out["personal"] == [0.0584, 0.7012] and out["global"] == []
    assert out["seconds"] == [93.25]


def test_fedproto_log_personal_accuracy_and_its_dashed_round_seconds(tmp_path):
    text = (
        "-------------Round number: 0-------------\n\nEvaluate personalized models\n"
        "Averaged Train Loss: 2.3021\nAveraged Test Accuracy: 0.0000\nStd Test Accuracy: 0.0000\n"
        + "-" * 50 + " 141.5\n"
        "-------------Round number: 1-------------\n\nEvaluate personalized models\n"
        "Averaged Train Loss: 1.2034\nAveraged Test Accuracy: 0.6421\nStd Test Accuracy: 0.1200\n"
        + "-" * 50 + " 150.25\n"
    )  # fmt: skip
    path = tmp_path / "pfllib_FedProto_seed0.log"
    path.write_text(text)
    algorithm, out = in_subprocess("[METHODS['FedProto'], parse_pfllib_log(sys.argv[1])]", path)
    assert algorithm == "fedproto"
    assert out["personal"] == [0.0, 0.6421] and out["global"] == []
    assert out["seconds"] == [141.5, 150.25] and out["train_loss"] == [2.3021, 1.2034]


def test_fedgen_global_and_fd_personal_curves_only_the_methods_asked(tmp_path):
    logs, work = tmp_path / "logs", tmp_path / "pfljax"
    logs.mkdir()
    # FedGen prints its global model's accuracy; FD its personalized models', with a dashed Budget line.
    fedgen = "".join(ROUND.format(r=r, loss=1.0, acc=a) for r, a in enumerate([0.1, 0.5]))
    fd = "".join(
        f"-------------Round number: {r}-------------\n\nEvaluate personalized models\n"
        f"Averaged Train Loss: 1.0\nAveraged Test Accuracy: {a}\n" + "-" * 50 + " 20.5\n"
        for r, a in enumerate([0.1, 0.8])
    )
    for s in (0, 1):
        (logs / f"pfllib_FedGen_seed{s}.log").write_text(fedgen + "Average time cost: 1s.\n")
        (logs / f"pfllib_FD_seed{s}.log").write_text(fd + "Average time cost: 1s.\n")
        (logs / f"pfllib_FedAvg_seed{s}.log").write_text(fedgen + "Average time cost: 1s.\n")
        for algorithm, accs in (("fedgen", [0.5]), ("feddistill", [0.8, 0.9]), ("fedavg", [0.5])):
            write_pfljax_run(work / algorithm / f"seed_{s}", accs, 1.0)
    out = run_differential(logs, work, "--methods=FD,FedGen")
    assert "| FedGen | PFLlib | 2 | 1 | 50.00 +- 0.00 | 50.00 +- 0.00 |  |" in out, out
    assert "| FD | PFLlib | 2 | 1 | 80.00 +- 0.00 | 80.00 +- 0.00 |  |" in out, out
    # pfljax's FD ran a round more (0.9 after round 2): its best is taken over round 1, PFLlib's rounds.
    assert "| FD | pfljax (mine) | 2 | 1 | 80.00 +- 0.00 | 80.00 +- 0.00 | +nan |" in out, out
    assert "| FD | seed 0: 20, seed 1: 20 | 2 (2 seeds) |" in out, out
    assert "FedAvg" not in out, out  # not asked for, though its logs and workdir are there
    assert out.index("| FedGen | PFLlib") < out.index("| FD | PFLlib"), out  # METHODS' order
