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
  then each client's samples split 75/25 into train/test;
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

Where pfljax differs, and why:
- normalisation: PFLlib maps pixels to [-1, 1] (ToTensor + Normalize(0.5, 0.5)); the
  pfljax Fashion-MNIST source gives [0, 1] (or a train-set standardisation,
  source.standardize) and has no [-1, 1] option: not added, to keep the source as it
  is (an input scale of 1/2 and shift, which an SGD run at lr 0.005 may feel);
- train/test split per client: PFLlib's is sklearn's train_test_split(train_size=0.75,
  shuffle=True) from numpy's global stream, floor(0.75 n) train and the rest test,
  not stratified; pfljax's is stratified by label with round(0.25 n) test samples
  (partition.stratified_split) and drawn from default_rng(data_seed): per client the
  sizes differ by at most one sample and the samples themselves differ;
- batches: PFLlib's train loader drops the last incomplete batch (drop_last=True),
  pfljax's local epoch ends with it (ceil(n / 10) steps, the last one smaller);
- initialisation: flax's (LeCun-normal kernels, zero biases), not torch's default
  (Kaiming-uniform with a=sqrt(5), uniform biases), and a jax PRNG instead of torch's;
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
    config.num_clients = 20
    config.clients_per_round = 0  # join ratio 1
    config.rounds = 2000
    config.local_steps = 0
    config.local_epochs = 1
    config.batch_size = 10
    config.optimizer = "sgd"
    config.learning_rate = 0.005
    config.momentum = 0.0
    config.weight_decay = 0.0
    config.loss = "cross_entropy"
    config.model = "cnn"  # PFLlib's FedAvgCNN for 28x28x1 inputs
    config.model_kwargs = ml_collections.ConfigDict(
        {"channels": (32, 64), "dense": (512,), "kernel_size": 5, "padding": "VALID"}
    )
    config.eval_every = 1
    config.checkpoint_every = 50
    return config
