"""Small datasets and a tiny model that the demos train without any download.

* :class:`SyntheticRegression` -- a deterministic map-style regression set.
* :class:`CharTextDataset` -- next-character prediction over ``tiny.txt``, a
  ~20 KB story written for this package (public domain), or any text you pass.
* :class:`TinyLM` -- a small decoder-only transformer whose ``blocks`` are an
  ``nn.ModuleList`` of :class:`Block`, so ZeRO-3 can shard it block by block.

All of them are ordinary map-style ``torch.utils.data.Dataset`` /
``nn.Module`` objects: the training layer shards a dataset over the ranks with
``DistributedSampler`` (see :func:`dpnb.engine.train.training.set_data`), so the same
object is built identically on every rank (same seed, same text) and each rank
reads only its own indices.
"""

from __future__ import annotations

import math
from importlib import resources

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

__all__ = [
    "SyntheticRegression",
    "CharTextDataset",
    "TinyLM",
    "Block",
    "load_tiny_text",
]


class SyntheticRegression(Dataset):
    """``n`` samples of ``y = tanh(x A) B + noise``, fully determined by ``seed``.

    Every rank that builds ``SyntheticRegression(n, in_dim, out_dim, seed)``
    gets bit-identical tensors, which is what lets data parallelism shard it by
    index alone.  Items are ``(x, y)`` float32 pairs of shapes ``(in_dim,)`` and
    ``(out_dim,)``; the default training loss for float targets is MSE.
    """

    def __init__(
        self,
        n: int = 1024,
        in_dim: int = 16,
        out_dim: int = 4,
        seed: int = 0,
        noise: float = 0.01,
        hidden: int = 32,
    ):
        if n <= 0 or in_dim <= 0 or out_dim <= 0:
            raise ValueError(
                f"SyntheticRegression needs positive sizes, got n={n}, "
                f"in_dim={in_dim}, out_dim={out_dim}"
            )
        g = torch.Generator().manual_seed(seed)
        self.n, self.in_dim, self.out_dim, self.seed = n, in_dim, out_dim, seed
        self.x = torch.randn(n, in_dim, generator=g)
        a = torch.randn(in_dim, hidden, generator=g) / math.sqrt(in_dim)
        b = torch.randn(hidden, out_dim, generator=g) / math.sqrt(hidden)
        self.y = torch.tanh(self.x @ a) @ b + noise * torch.randn(n, out_dim, generator=g)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __repr__(self) -> str:
        return (
            f"SyntheticRegression(n={self.n}, in_dim={self.in_dim}, "
            f"out_dim={self.out_dim}, seed={self.seed})"
        )


def load_tiny_text() -> str:
    """The text of the shipped ``dpnb/data/tiny.txt``."""
    return resources.files(__name__).joinpath("tiny.txt").read_text(encoding="utf-8")


class CharTextDataset(Dataset):
    """Next-character prediction windows over a small text.

    Item ``i`` is ``(x, y)`` with ``x = ids[i : i + seq_len]`` and
    ``y = ids[i + 1 : i + seq_len + 1]`` (int64), so there are
    ``len(text) - seq_len`` overlapping windows (``stride`` > 1 spaces them
    out).  Targets are integer ids, so the default training loss is
    cross-entropy over ``vocab_size`` classes and each sample counts
    ``seq_len`` tokens.

    The vocabulary is the sorted set of characters in the text; build the
    dataset from the same text on every rank and the ids agree everywhere.
    """

    def __init__(self, seq_len: int = 64, text: str | None = None, stride: int = 1):
        if text is None:
            text = load_tiny_text()
        if seq_len < 1 or stride < 1:
            raise ValueError(f"seq_len and stride must be >= 1, got {seq_len}, {stride}")
        if len(text) <= seq_len:
            raise ValueError(
                f"the text has {len(text)} characters, fewer than seq_len+1="
                f"{seq_len + 1}; use a shorter seq_len or a longer text"
            )
        self.text = text
        self.seq_len = seq_len
        self.stride = stride
        self.chars = sorted(set(text))
        self.vocab_size = len(self.chars)
        self._stoi = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([self._stoi[c] for c in text], dtype=torch.long)

    def encode(self, s: str) -> list[int]:
        missing = sorted({c for c in s if c not in self._stoi})
        if missing:
            raise ValueError(
                f"characters {missing!r} are not in this dataset's vocabulary "
                f"({self.vocab_size} characters)"
            )
        return [self._stoi[c] for c in s]

    def decode(self, ids) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(self.chars[int(i)] for i in ids)

    def __len__(self) -> int:
        return (len(self.data) - self.seq_len - 1) // self.stride + 1

    def __getitem__(self, i):
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        s = i * self.stride
        chunk = self.data[s : s + self.seq_len + 1]
        return chunk[:-1], chunk[1:]

    def __repr__(self) -> str:
        return (
            f"CharTextDataset(seq_len={self.seq_len}, chars={len(self.text)}, "
            f"vocab_size={self.vocab_size}, windows={len(self)})"
        )


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyLM(nn.Module):
    """A tiny character-level GPT: embeddings, ``n_layers`` blocks, a head.

    ``forward(idx)`` maps int64 ids ``(batch, T)`` with ``T <= seq_len`` to
    logits ``(batch, T, vocab_size)``.  No dropout, so with a fixed seed two
    ranks (or a rank and a single-process reference) compute the same thing.
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        seq_len: int = 64,
    ):
        super().__init__()
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, idx):
        t = idx.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence of length {t} is longer than seq_len={self.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))

    @torch.no_grad()
    def generate(self, idx, n: int, temperature: float = 1.0, generator=None):
        """Append ``n`` sampled ids to ``idx`` ``(batch, T)`` and return it.

        Run it on an unwrapped model (or on every rank at once for FSDP, whose
        forward all-gathers parameters)."""
        for _ in range(n):
            logits = self(idx[:, -self.seq_len :])[:, -1, :] / max(temperature, 1e-6)
            nxt = torch.multinomial(F.softmax(logits.float(), dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx
