"""PFLlib's own code run as the oracle: a wrapper of its unmodified `system/main.py`.

Runs in PFLlib's environment (torch; nothing of pfljax is imported, so it needs neither
jax nor absl: its flags are argparse's, and everything after `--` goes to main.py):

    P="python experiments/pfllib/pfllib_side.py --system=$PFLLIB/system"
    $P run --seed=1 -- -data FashionMNIST -m CNN -algo FedAvg -gr 20 ...     # one seed's run
    $P record --out=gpfl.npz -- -data FashionMNISToracle -algo GPFL ...      # weights before/after
    $P time --threads=2 --out=round.json -- -data FashionMNIST -algo FedCP ... # training seconds
    $P export_init --out_dir=init --seeds=0,1,2                                # FedAvgCNN's init
    $P cut --source=FashionMNIST --name=FashionMNISToracle                     # the tiny dataset

Modes:
- run: main.py with its module-level `torch.manual_seed(0)` made `manual_seed(SEED)` (every
  later call, e.g. each client constructor's `manual_seed(0)`, untouched).
- record: saves to an .npz the initial global model ("init.model.*"), what every client and the
  server hold when training starts ("start.client<i>.*", "start.client<i>.attr.<name>",
  "start.server.attr.<name>") and after it ("final.*": the global model if any, each client's
  model, and every tensor, number list and module attribute of each client and of the server;
  dicts and lists of tensors as "<name>.<key>"), and rs_test_acc ("acc"). Changes to PFLlib's
  behaviour, each off unless asked: `--rotate=K` (round r trains clients r..r+K-1 mod C, in place
  of the random selection), `--no_gumbel` (FedCP's policy softmax(x / tau)), `--fixed_draws`
  (FedGen's generator noise 0, its labels the first n of its list), `--cp_send_all` (FedCP's new
  global head and CPN copied to every client), `--proto_keep` (FedProto: a class no participant
  holds keeps its prototype), `--no_mkldnn` (torch's own convolution kernels, not oneDNN's).
- time: every `Server.evaluate` timed; writes the seconds between the end of evaluation i and
  the start of evaluation i + 1 (round i: training and aggregation) and stops at the third.
- export_init: FedAvgCNN(1, 10, 1024)'s state_dict after `torch.manual_seed(s)`, as main.py's
  module-level seed then its model, to `<out_dir>/fedavgcnn_seed<s>.npz`.
- cut: a dataset of a few clients cut from a PFLlib dataset (`dataset/<source>`): client i of
  the new one is `--clients`[i] of the source, its train then test rows drawn by
  `default_rng(i).choice(n, rows, replace=False)`.
torch runs on one thread (`--threads`) unless told otherwise.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import runpy
import sys
import time

import numpy as np

MODES = ("run", "record", "time", "export_init", "cut")


class OneLineParser(argparse.ArgumentParser):
    """argparse with a bad flag as one line, `error: ...`, and exit code 2 (no usage block)."""

    def error(self, message):
        sys.stderr.write(f"error: {message}\n")
        sys.exit(2)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(wrapper options, main.py's arguments: everything after `--`)."""
    own, main_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--system", required=True, help="PFLlib's system/ directory")
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("--seed", type=int, default=None, help="main.py's module-level seed (default 0)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--out", help="record: the .npz; time: the .json")
    parser.add_argument("--rotate", type=int, default=0, help="record: K clients a round, rotating")
    for flag in ("no_gumbel", "fixed_draws", "cp_send_all", "proto_keep", "no_mkldnn"):
        parser.add_argument(f"--{flag}", action="store_true")
    parser.add_argument("--out_dir", help="export_init: where the .npz files go")
    parser.add_argument("--seeds", default="0,1,2", help="export_init: comma-separated seeds")
    parser.add_argument("--source", default="FashionMNIST", help="cut: the PFLlib dataset to cut from")
    parser.add_argument("--name", default="FashionMNISToracle", help="cut: the new dataset's name")
    parser.add_argument("--clients", default="1,7,13", help="cut: the source's clients")
    parser.add_argument("--train_rows", type=int, default=10)
    parser.add_argument("--test_rows", type=int, default=20)
    opts = parser.parse_args(own)
    if opts.mode in ("record", "time") and not opts.out:
        parser.error(f"{opts.mode} needs --out")
    if opts.mode == "export_init" and not opts.out_dir:
        parser.error("export_init needs --out_dir")
    if opts.rotate < 0 or opts.threads < 1:
        parser.error("--rotate must be >= 0 and --threads >= 1")
    if not os.path.isfile(os.path.join(opts.system, "main.py")):
        parser.error(f"--system={opts.system}: no main.py there (PFLlib's system/ directory)")
    return opts, main_args


def cut(system: str, source: str, name: str, clients: list[int], train_rows: int, test_rows: int) -> None:
    """Writes dataset/<name>/{train,test}/<i>.npz: rows of the source's client clients[i], drawn by
    default_rng(i), its train rows first."""
    root = os.path.join(system, "..", "dataset")
    for split in ("train", "test"):
        os.makedirs(os.path.join(root, name, split), exist_ok=True)
    for i, c in enumerate(clients):
        rng = np.random.default_rng(i)
        for split, rows in (("train", train_rows), ("test", test_rows)):
            data = np.load(os.path.join(root, source, split, f"{c}.npz"), allow_pickle=True)["data"].tolist()
            pick = rng.choice(len(data["y"]), rows, replace=False)
            out = {"x": data["x"][pick], "y": data["y"][pick]}
            np.savez_compressed(os.path.join(root, name, split, f"{i}.npz"), data=out)


class Recorder:
    """Tensors of PFLlib's modules and objects under dotted names (the module docstring)."""

    def __init__(self, torch):
        self.torch, self.rec = torch, {}

    def state(self, prefix: str, module) -> None:
        for k, v in module.state_dict().items():
            self.rec[f"{prefix}.{k}"] = v.detach().cpu().numpy().copy()

    def attributes(self, prefix: str, obj) -> None:
        torch = self.torch
        for name, v in vars(obj).items():
            if isinstance(v, torch.Tensor):
                self.rec[f"{prefix}.{name}"] = v.detach().cpu().numpy().copy()
            elif isinstance(v, torch.nn.Module) and name != "model":
                self.state(f"{prefix}.{name}", v)
            elif isinstance(v, (dict, list)):
                for k, t in v.items() if isinstance(v, dict) else enumerate(v):
                    if isinstance(t, torch.Tensor):
                        self.rec[f"{prefix}.{name}.{k}"] = t.detach().cpu().numpy().copy()
                    elif isinstance(t, (int, float)):
                        self.rec[f"{prefix}.{name}.{k}"] = np.float64(t)
                    elif isinstance(t, torch.nn.Module):
                        self.state(f"{prefix}.{name}.{k}", t)

    def server(self, tag: str, server) -> None:
        for c in server.clients:
            self.state(f"{tag}.client{c.id}", c.model)
            self.attributes(f"{tag}.client{c.id}.attr", c)
        self.attributes(f"{tag}.server.attr", server)


def install_record(opts, serverbase, torch) -> None:
    """Wraps Server.__init__ to save the initial model and its train() to save the rest."""
    recorder, orig_init = Recorder(torch), serverbase.Server.__init__

    def init(self, *a, **k):
        orig_init(self, *a, **k)
        recorder.state("init.model", self.global_model)
        train = self.train

        def wrapped():
            recorder.server("start", self)
            try:
                train()
            except ZeroDivisionError:  # the mean time per round printed after a one-round run
                pass
            if getattr(self, "global_model", None) is not None:
                recorder.state("final.model", self.global_model)
            recorder.server("final", self)
            recorder.rec["acc"] = np.array(self.rs_test_acc)
            np.savez(opts.out, **recorder.rec)

        self.train = wrapped

    serverbase.Server.__init__ = init


def install_changes(opts, serverbase, torch) -> None:
    """The record mode's changes to PFLlib's behaviour that `opts` asks for."""
    if opts.no_mkldnn:
        torch.backends.mkldnn.enabled = False
    if opts.no_gumbel:
        torch.nn.functional.gumbel_softmax = lambda x, tau=1, hard=False, eps=1e-10, dim=-1: torch.softmax(
            x / tau, dim
        )
    if opts.fixed_draws:
        torch.rand = lambda *shape, **kw: torch.zeros(
            *shape, **{k: kw[k] for k in ("device", "dtype") if k in kw}
        )
        np.random.choice = lambda a, size=None, replace=True, p=None: np.resize(np.asarray(a), size or 0)
    if opts.rotate:
        calls = [0]

        def select_clients(self):
            r, calls[0] = calls[0], calls[0] + 1
            return [self.clients[(r + j) % len(self.clients)] for j in range(opts.rotate)]

        serverbase.Server.select_clients = select_clients
    if opts.cp_send_all:
        from flcore.servers import servercp

        servercp.FedCP.global_head = send_to_all(servercp.FedCP.global_head, "head", lambda c: c.model.head_g)
        servercp.FedCP.global_cs = send_to_all(servercp.FedCP.global_cs, "cs", lambda c: c.model.gate.cs)
    if opts.proto_keep:
        from flcore.servers import serverproto

        send = serverproto.FedProto.send_protos

        def send_protos(self):
            kept = getattr(self, "_kept", {})
            kept.update({k: v for k, v in self.global_protos.items() if not isinstance(v, list)})
            self._kept, self.global_protos = kept, collections.defaultdict(list, kept)
            send(self)

        serverproto.FedProto.send_protos = send_protos


def send_to_all(method, attribute: str, target):
    """FedCP's global_head / global_cs, then the new module copied into every client's."""

    def wrapped(self):
        method(self)
        for c in self.clients:
            for src, dst in zip(getattr(self, attribute).parameters(), target(c).parameters()):
                dst.data = src.data.clone()

    return wrapped


def install_timer(opts, serverbase) -> None:
    """Times Server.evaluate; writes the rounds' seconds and exits at the third evaluation."""
    orig_init, marks = serverbase.Server.__init__, []

    def init(self, *a, **k):
        orig_init(self, *a, **k)
        evaluate = self.evaluate

        def timed(*a, **k):
            marks.append(("start", time.perf_counter()))
            starts = [t for m, t in marks if m == "start"]
            if len(starts) == 3:
                ends = [t for m, t in marks if m == "end"]
                with open(opts.out, "w") as f:
                    json.dump(
                        {"round_s": [s - e for e, s in zip(ends, starts[1:])], "threads": opts.threads}, f
                    )
                os._exit(0)
            out = evaluate(*a, **k)
            marks.append(("end", time.perf_counter()))
            return out

        self.evaluate = timed

    serverbase.Server.__init__ = init


def main(argv: list[str]) -> None:
    opts, main_args = parse(argv)
    system = os.path.abspath(opts.system)
    if opts.mode == "cut":
        clients = [int(c) for c in opts.clients.split(",")]
        return cut(system, opts.source, opts.name, clients, opts.train_rows, opts.test_rows)
    for attr in ("out", "out_dir"):
        if getattr(opts, attr):
            setattr(opts, attr, os.path.abspath(getattr(opts, attr)))
    os.chdir(system)
    sys.path.insert(0, system)
    import torch

    torch.set_num_threads(opts.threads)
    if opts.mode == "export_init":
        from flcore.trainmodel.models import FedAvgCNN

        for s in (int(s) for s in opts.seeds.split(",")):
            torch.manual_seed(s)
            model = FedAvgCNN(in_features=1, num_classes=10, dim=1024)
            state = {k: v.numpy() for k, v in model.state_dict().items()}
            np.savez(os.path.join(opts.out_dir, f"fedavgcnn_seed{s}.npz"), **state)
        return None
    if opts.seed is not None:
        first, calls = torch.manual_seed, [0]

        def seeded(s):
            calls[0] += 1
            return first(opts.seed if calls[0] == 1 else s)

        torch.manual_seed = seeded
    from flcore.servers import serverbase

    if opts.mode == "record":
        install_changes(opts, serverbase, torch)
        install_record(opts, serverbase, torch)
    elif opts.mode == "time":
        install_timer(opts, serverbase)
    sys.argv = ["main.py", *main_args]
    runpy.run_path("main.py", run_name="__main__")
    return None


if __name__ == "__main__":
    main(sys.argv[1:])
