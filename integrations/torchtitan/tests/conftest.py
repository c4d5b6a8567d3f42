"""Ranks are forked (fast on 2 cores); the parent must hold no OpenMP pool when it forks."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

torch.set_num_threads(1)
