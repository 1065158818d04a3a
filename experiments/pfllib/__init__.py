"""PFLlib's Fashion-MNIST protocol: the leaderboard driver and the differential against PFLlib's own code."""
