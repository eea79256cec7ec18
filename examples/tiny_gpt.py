"""A tiny GPT-style transformer (token embedding, causal self-attention, MLP blocks): the model
of examples/train_hsdp.py and of the mesh tests (tests/scripts/mesh_worker.py); plus what they
share: deterministic batches, a stateful data loader and a digest of (possibly sharded) state."""

from __future__ import annotations

import ctypes
import hashlib
import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class GPTConfig:
    vocab: int = 64
    seq: int = 16
    dim: int = 32
    heads: int = 2
    layers: int = 2


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.q = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.k = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.v = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.o = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # the local head count: under tensor parallelism q/k/v are column-sharded (heads split)
        q, k, v = self.q(x), self.k(x), self.v(x)
        d = q.shape[-1]
        hd = d // self.heads if d % self.heads == 0 and d // self.heads >= 1 else d
        h = d // hd

        def split(z: torch.Tensor) -> torch.Tensor:
            return z.view(b, t, h, hd).transpose(1, 2)

        q, k, v = split(q), split(k), split(v)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.o(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.down = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.layers)])
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def batch(step: int, dp_rank: int, cfg: GPTConfig, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch of token sequences for (step, data-parallel rank)."""
    g = torch.Generator().manual_seed(7919 * step + 104729 * dp_rank + 1)
    tokens = torch.randint(0, cfg.vocab, (size, cfg.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model: nn.Module, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


class TokenLoader:
    """A data loader over a synthetic token corpus with a position a job can save and restore
    (``state_dict`` / ``load_state_dict``: what ``tm.track`` needs): each epoch a seeded
    permutation of the sequences, cut into batches, every data-parallel rank its own slice."""

    def __init__(self, cfg: GPTConfig, dp_rank: int, dp_size: int, sequences: int = 256, batch: int = 4,
                 seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, cfg.vocab, (sequences, cfg.seq + 1), generator=g)
        self.dp_rank, self.dp_size, self.batch, self.seed = dp_rank, dp_size, batch, seed
        self.epoch = 0
        self.position = 0  # batches of this epoch already handed out

    def _order(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        return torch.randperm(len(self.tokens), generator=g)

    def batches_per_epoch(self) -> int:
        return len(self.tokens) // (self.batch * self.dp_size)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.position >= self.batches_per_epoch():
            self.epoch, self.position = self.epoch + 1, 0
        start = (self.position * self.dp_size + self.dp_rank) * self.batch
        rows = self.tokens[self._order()[start:start + self.batch]]
        self.position += 1
        return rows[:, :-1], rows[:, 1:]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _bytes(t: torch.Tensor) -> bytes:
    t = local(t).detach().contiguous().cpu()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())  # no numpy needed


def digest(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> str:
    """SHA-256 of this rank's local state: parameters and buffers (local shards), then the
    optimizer's tensors (local shards), in a fixed order."""
    sha = hashlib.sha256()
    for name, value in model.state_dict().items():
        sha.update(name.encode())
        sha.update(_bytes(value))
    if optimizer is not None:
        for state in optimizer.state.values():
            for key in sorted(state):
                if isinstance(state[key], torch.Tensor):
                    sha.update(_bytes(state[key]))
    return sha.hexdigest()
