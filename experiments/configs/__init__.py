"""Shims: the configs live in pfljax/experiment/configs/ (shipped with pfljax)."""
