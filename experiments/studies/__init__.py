"""Studies of the seed methods and of privacy: the runs behind tables and figures in experiments/results/."""
