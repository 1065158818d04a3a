"""A run as its loop, outputs and reports see it: frozen settings made once by `config.prepare`.

After `prepare`, nothing reads the ConfigDict: the run loop (`loop`), the summary and the
plots (`reports`) take a `RunSettings`, made by `pfljax.experiment.config.run_settings`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pfljax.core import privacy

MAX_BLOCK_ROUNDS = 100  # block_rounds=0 (auto): at most this many rounds between host visits
MAX_BLOCK_BYTES = 256 * 2**20  # auto: the stacked per-round outputs of a block stay below this


@dataclasses.dataclass(frozen=True)
class Schedule:
    """When a run evaluates, checkpoints and returns to the host.

    Attributes:
      rounds: the rounds of the run.
      eval_every: rounds between evaluations (the last round is always evaluated).
      checkpoint_every: rounds between checkpoints (0: only at the end).
      block_rounds: rounds per compiled block (0: auto, `block_length`).
    """

    rounds: int
    eval_every: int = 1
    checkpoint_every: int = 5
    block_rounds: int = 0

    def block_length(self, start: int, end: int, round_bytes: int) -> int:
        """L: block_rounds, or (auto) the rounds to the next checkpoint, at most
        MAX_BLOCK_ROUNDS and what MAX_BLOCK_BYTES of stacked outputs allow."""
        if self.block_rounds:
            return int(self.block_rounds)
        span = self.checkpoint_every or self.rounds
        fits = MAX_BLOCK_BYTES // round_bytes if round_bytes else MAX_BLOCK_ROUNDS
        return max(1, min(span, end - start, MAX_BLOCK_ROUNDS, fits))

    def block_end(self, r: int, end: int, length: int) -> int:
        """The last round of the block starting after round r."""
        stop = min(r + length, end)
        if self.checkpoint_every:
            stop = min(stop, (r // self.checkpoint_every + 1) * self.checkpoint_every)
        return stop

    def is_checkpoint(self, r: int, end: int) -> bool:
        return bool(self.checkpoint_every and r % self.checkpoint_every == 0) or r == end


@dataclasses.dataclass(frozen=True)
class Accounting:
    """Client-level DP of a run as the accountant and the reports see it.

    Attributes:
      noise_multiplier, clip_norm: `pfljax.core.privacy.ClientDP`'s.
      delta: the accountant's delta (resolved: never 0).
      target_epsilon: the budget (0: none): the run stops before a round that would pass it.
      num_clients, clients_per_round: C and the participants of a round (resolved: never 0).
    """

    noise_multiplier: float
    clip_norm: float
    delta: float
    target_epsilon: float
    num_clients: int
    clients_per_round: int

    def epsilons(self, rounds: int) -> np.ndarray:
        """Epsilon at `delta` after 0..rounds rounds (one accountant call)."""
        k = self.clients_per_round
        return privacy.epsilons(self.noise_multiplier, self.num_clients, k, rounds, self.delta)

    def last_round(self, eps: np.ndarray, rounds: int) -> int:
        """`rounds`, or the last round within target_epsilon."""
        if not self.target_epsilon:
            return rounds
        within = np.nonzero(eps[1:] > self.target_epsilon)[0]
        return int(within[0]) if within.size else rounds

    def report(self, eps: np.ndarray, rounds_run: int) -> dict:
        """The summary's dp_* entries after `rounds_run` rounds."""
        return {
            "dp_epsilon": float(eps[rounds_run]),
            "dp_delta": self.delta,
            "dp_noise_multiplier": self.noise_multiplier,
            "dp_clip_norm": self.clip_norm,
        }


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a run's clients live and how many train in a round.

    Attributes:
      storage: "device" (every client on the device(s)) or "host" (clients in host
        memory, a round's participants moved to one device: `pfljax.runtime.offload`).
      replicate_data: with several devices, the data on every device (not sharded).
      clients_per_round: the participants of a round (None: every client).
    """

    storage: str = "device"
    replicate_data: bool = False
    clients_per_round: int | None = None


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """One run (or one replica of a vectorized sweep) as its loop and reports see it.

    Attributes:
      algorithm, seed, dataset, partition, num_clients: the summary's identification
        (`partition` is "users" for a natural data set).
      title: '<dataset>, <C> clients, partition <p>', the plots' and tables' title.
      schedule: rounds, evaluations, checkpoints and blocks.
      placement: where the clients live, how many train in a round.
      dp: the DP accounting, or None without client-level DP.
      divergence_knobs: the settings that usually make a run diverge ("name=value, ...").
      divergence_advice: smaller settings to try ("--config.x=v or ...").
    """

    algorithm: str
    seed: int
    dataset: str
    partition: str
    num_clients: int
    title: str
    schedule: Schedule
    placement: Placement = Placement()
    dp: Accounting | None = None
    divergence_knobs: str = ""
    divergence_advice: str = ""

    @property
    def rounds(self) -> int:
        return self.schedule.rounds

    def epsilons(self) -> np.ndarray | None:
        """Epsilon after 0..rounds rounds, or None without client-level DP."""
        return None if self.dp is None else self.dp.epsilons(self.rounds)

    def last_round(self, eps: np.ndarray | None) -> int:
        """The last round to run: `rounds`, or the last within the DP budget."""
        return self.rounds if self.dp is None else self.dp.last_round(eps, self.rounds)

    def divergence_message(self, round_index: int, what: str, workdir: str) -> str:
        """The one line that reports a diverged run: round, what was non-finite,
        algorithm, the knobs that usually cause it and smaller settings to try."""
        return (
            f"{self.algorithm} diverged at round {round_index} of {self.rounds} ({what}); "
            f"usual causes: {self.divergence_knobs}; try {self.divergence_advice}; "
            + (f"outputs up to round {round_index - 1}" if round_index > 1 else "data, config and plots")
            + f" kept in {workdir} (summary.json status 'diverged')"
        )
