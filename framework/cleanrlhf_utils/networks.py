"""Ensembles as one batched network: SAC's twin critics and the reward model's members are `members` independent MLPs
evaluated with one batched matmul per layer instead of one small matmul per member."""

import math

import torch
import torch.nn as nn


class EnsembleLinear(nn.Module):
    """`members` independent linear layers evaluated with one batched matmul: (E, N, in) -> (E, N, out)."""

    def __init__(self, members: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(members, in_features, out_features))
        self.bias = nn.Parameter(torch.empty(members, 1, out_features))
        bound = 1 / math.sqrt(in_features)  # nn.Linear's default initialisation, per member
        nn.init.uniform_(self.weight, -bound, bound)
        nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.baddbmm(self.bias, x, self.weight)


def ensemble_mlp(members: int, in_dim: int, hidden_dim: int, hidden_layers: int, out_dim: int, activation=nn.ReLU, dropout: float = 0.0):
    layers, width = [], in_dim
    for _ in range(hidden_layers):
        layers += [EnsembleLinear(members, width, hidden_dim), activation()]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        width = hidden_dim
    layers.append(EnsembleLinear(members, width, out_dim))
    return nn.Sequential(*layers)
