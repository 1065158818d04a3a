"""experiments/pfllib/pfllib_side.py's parts that need no torch: the tiny dataset's cut (client
i's train then test rows drawn by default_rng(i)) and the flags (main.py's after `--`)."""

import numpy as np
import pytest

from experiments.pfllib import pfllib_side


def test_cut_takes_the_rows_default_rng_i_draws(tmp_path):
    system, rng = tmp_path / "system", np.random.default_rng(5)
    system.mkdir()
    sizes = {3: (30, 12), 8: (25, 40)}
    source = {}
    for split, k in (("train", 0), ("test", 1)):
        (tmp_path / "dataset" / "Src" / split).mkdir(parents=True)
        for c, n in sizes.items():
            data = {
                "x": rng.normal(size=(n[k], 1, 28, 28)).astype(np.float32),
                "y": rng.integers(0, 10, n[k]),
            }
            np.savez(tmp_path / "dataset" / "Src" / split / f"{c}.npz", data=data)
            source[split, c] = data
    pfllib_side.cut(str(system), "Src", "Tiny", [8, 3], train_rows=4, test_rows=6)
    for i, c in enumerate([8, 3]):
        draw = np.random.default_rng(i)
        for split, rows in (("train", 4), ("test", 6)):
            pick = draw.choice(len(source[split, c]["y"]), rows, replace=False)
            got = np.load(tmp_path / "dataset" / "Tiny" / split / f"{i}.npz", allow_pickle=True)[
                "data"
            ].tolist()
            np.testing.assert_array_equal(got["x"], source[split, c]["x"][pick])
            np.testing.assert_array_equal(got["y"], source[split, c]["y"][pick])


@pytest.fixture
def system(tmp_path):
    """A directory that looks like PFLlib's system/ (its main.py)."""
    (tmp_path / "main.py").write_text("")
    return str(tmp_path)


def test_flags_split_at_the_double_dash(system):
    argv = [f"--system={system}", "record", "--out=o.npz", "--rotate=2", "--no_gumbel"]
    opts, main_args = pfllib_side.parse([*argv, "--", "-algo", "FedCP", "-jr", "0.67"])
    assert (opts.mode, opts.out, opts.rotate) == ("record", "o.npz", 2)
    assert opts.no_gumbel and not opts.cp_send_all
    assert main_args == ["-algo", "FedCP", "-jr", "0.67"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["record"], "record needs --out"),
        (["export_init"], "export_init needs --out_dir"),
        (["run", "--rotate=-1"], "--rotate must be >= 0"),
        (["train"], "invalid choice: 'train'"),
        (["run", "--system=/nonexistent"], "--system=/nonexistent: no main.py there"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(argv, message, system, capsys):
    with pytest.raises(SystemExit) as e:
        pfllib_side.parse([f"--system={system}", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
