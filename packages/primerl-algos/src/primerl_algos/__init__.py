"""primerl-algos: losses, advantages, filters, trajectory merging and packing.

Pure functions over tensors (losses) and rollouts/samples (the rest); each kind has a small
registry, and configs may name a plugin by import path instead (`package.module:function`).
Importing this package does not import torch: `primerl_algos.losses` does.
"""
