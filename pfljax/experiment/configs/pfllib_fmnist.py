"""PFLlib's Fashion-MNIST benchmark setting (TsingZ0/PFLlib), 20 clients, all in every round.

    python -m experiments.compare --config=experiments/configs/pfllib_fmnist.py:dir \\
        --algorithms=fedavg,fedprox,ditto --seeds=0,1,2 --workdir=runs/pfllib_dir
    # the pathological split: ":pat"; fewer rounds: --config.rounds=N

The argument is one of SETTINGS:
- dir (default): PFLlib's "practical non-IID" split, `generate_FashionMNIST.py noniid - dir`
  (partition="pfllib_dirichlet", Dirichlet alpha 0.1);
- pat: its "pathological non-IID" split, `generate_FashionMNIST.py noniid - pat`
  (partition="pfllib_pathological", 2 classes per client, unbalanced).

What is PFLlib's, read from its code (dataset/generate_FashionMNIST.py,
dataset/utils/dataset_utils.py, system/main.py, system/flcore/trainmodel/models.py,
system/flcore/servers/serverbase.py and serveravg.py, system/flcore/clients/clientbase.py):
- data: the 60000 training and 10000 test images merged (70000), split among 20
  clients with numpy seeded 1 (`np.random.seed(1)`); "dir": per class in turn,
  shuffle its indices, proportions ~ Dir(0.1) over clients, clients already holding
  >= N / C samples get none, redrawn until every client has at least
  least_samples = int(min(batch 10 / (1 - 0.75), 70000 / 20 / 2)) = 40 samples;
  "pat": class k goes to the first ceil(20 / 10 * 2) = 4 clients with a class slot
  left (so clients 4j..4j+3 hold classes 2j, 2j+1), unbalanced shares drawn with
  randint(max(m / 10, 40 / 10), m), m = n_k / 4, the last client the rest
  (pfljax.data.partition.pfllib_dirichlet / pfllib_pathological: the same draws from
  RandomState(data_seed=1), so the same client index sets as PFLlib's files);
  then each client's samples, in client order, split by sklearn's
  train_test_split(train_size=0.75, shuffle=True) on the same global stream:
  floor(0.75 n) train, the rest test, one RandomState.permutation(n) per client
  (test_split="pfllib", partition.pfllib_train_test_split: the same draws, so the
  same train and test sets, in PFLlib's row order);
- pixels: ToTensor + Normalize([0.5], [0.5]), i.e. (x / 255 - 0.5) / 0.5 in [-1, 1],
  float32 (source.pixel_scale="symmetric", idx.pixel_levels: the same floats);
- batches: the train DataLoader shuffles and drops the last incomplete batch
  (drop_last=True): floor(n / 10) steps per epoch (config.drop_last=True);
- model: FedAvgCNN(in_features=1, num_classes=10, dim=1024): 5x5 conv 32 (no
  padding) + ReLU + 2x2 max-pool, 5x5 conv 64 (no padding) + ReLU + 2x2 max-pool,
  dense 1024 -> 512 + ReLU, dense 512 -> 10; 582,026 parameters. Here the library CNN
  with channels (32, 64), dense (512,), kernel 5, VALID padding: the same layers
  (tests/models/test_models.py checks the count);
- training: SGD lr 0.005 without momentum (torch.optim.SGD defaults), no weight
  decay, no learning-rate decay, batch 10, 1 local epoch, join ratio 1 (all 20
  clients every round), 2000 global rounds, evaluation every round (eval_gap 1),
  cross-entropy;
- reported accuracy: test accuracy summed over clients' correct predictions divided
  by their total test samples (the sample-weighted mean, pfljax's mean_accuracy),
  and the best of it over rounds (result_utils.average_data: mean and std of the
  best accuracy over the runs); PFLlib runs `-t` times on the same generated data,
  so here the partition is fixed (data_seed=1) and `seed` varies initialisation and
  batch order.

The data are PFLlib's exactly: tests/data/test_pfllib_exact.py checks every client's
train and test index sets (and its images, bit for bit, in file order) against a
fixture that PFLlib's own generator produced (tests/data/fixtures/, its README says how).

Where pfljax differs, and why:
- batch order: each epoch's shuffle comes from a jax PRNG (seed), not torch's
  RandomSampler; the same batches per epoch (floor(n / 10), full), other samples in them;
- initialisation: torch.nn's default distribution (model_kwargs.init_scheme="torch":
  kernels and biases U(+-1 / sqrt(fan_in)), as PFLlib's FedAvgCNN) drawn from a jax PRNG
  instead of torch's; the models of Factorized-FL and pFedPara keep their own
  initialisation (the option is dropped for them, with a note). flax's default
  (LeCun-normal kernels, sqrt(3) times wider, zero biases) learned faster than PFLlib in the
  first rounds (experiments/results/pfllib_differential.md). PFLlib's very weights:
  `--config.init_params=` a .npz of its FedAvgCNN's state_dict after `torch.manual_seed(s)`
  (pfljax.models.weights; every pfljax seed then starts from them; `seed{seed}.npz` in the
  path: each seed from its own file);
- evaluation time: PFLlib evaluates the models sent to clients at the start of
  rounds 0..2000 (round 0 is the untrained model, the last round's update is never
  evaluated); pfljax evaluates after each round's update, rounds 1..R. For the
  personalised methods each pfljax algorithm evaluates its own personal models
  (see its module), which need not be where PFLlib's server for that method evaluates;
- per-algorithm options (FedProx mu, Ditto lambda, Per-FedAvg alpha/beta, pFedMe
  lambda/K, FedFomo M, FedALA eta/rand_percent/layer_idx, FedRep head epochs, APFL
  alpha, and all options of FedFac, Factorized-FL, pFedLA, FedeRiCo) are pfljax's
  defaults (config.<algorithm>.*), not PFLlib's main.py defaults; the optimizer is
  fixed to SGD 0.005 for every method, FedeRiCo included (its pfljax "auto"
  optimizer would be Adam 1e-3).
"""

from __future__ import annotations

import ml_collections

from pfljax.experiment.configs import default

SETTINGS = ("dir", "pat")


def get_config(arg: str = "dir") -> ml_collections.ConfigDict:
    setting = arg or SETTINGS[0]
    if setting not in SETTINGS:
        raise ValueError(f"config argument must be one of {SETTINGS}; got {arg!r}")
    config = default.get_config()
    config.algorithm = "fedavg"
    config.dataset = "fashion_mnist"
    config.data_seed = 1  # PFLlib's np.random.seed(1): one partition for every run
    if setting == "dir":
        config.partition = "pfllib_dirichlet"
        config.dirichlet_alpha = 0.1
    else:
        config.partition = "pfllib_pathological"
        config.classes_per_client = 2
    config.samples_per_client = 0  # all 70000 samples
    config.test_fraction = 0.25
    config.test_split = "pfllib"  # sklearn's train_test_split(train_size=0.75) on PFLlib's stream
    config.source.pixel_scale = "symmetric"  # [-1, 1]: ToTensor + Normalize(0.5, 0.5)
    config.num_clients = 20
    config.clients_per_round = 0  # join ratio 1
    config.rounds = 2000
    config.local_steps = 0
    config.local_epochs = 1
    config.batch_size = 10
    config.drop_last = True  # PFLlib's train DataLoader(drop_last=True)
    config.optimizer = "sgd"
    config.learning_rate = 0.005
    config.momentum = 0.0
    config.weight_decay = 0.0
    config.loss = "cross_entropy"
    config.model = "cnn"  # PFLlib's FedAvgCNN for 28x28x1 inputs
    config.model_kwargs = ml_collections.ConfigDict(
        # torch.nn's default initialisation, as PFLlib's FedAvgCNN starts (flax's LeCun-normal
        # kernels, sqrt(3) times wider, learn faster in the first rounds: see
        # experiments/results/pfllib_differential.md)
        {"channels": (32, 64), "dense": (512,), "kernel_size": 5, "padding": "VALID", "init_scheme": "torch"}
    )
    config.eval_every = 1
    config.checkpoint_every = 50
    return config
