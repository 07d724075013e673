"""A GPT-2-style decoder (Radford et al., "Language Models are Unsupervised
Multitask Learners", 2019) with every transformer block a remat stage.

Token and position embeddings run before the chain, each pre-LayerNorm
block is one stage, and the final LayerNorm and the language-model head run
after it. The head shares its weight with the token embedding unless
``tied=False``. Parameter names follow the common layout
(``transformer.wte``, ``transformer.h.0.attn.c_attn``, ``transformer.ln_f``,
``lm_head``); Linear weights are stored as (out, in).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError
from ..stage import stage
from ._common import open_chain

__all__ = ["GPT", "Block", "gpt2"]


class _CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused q/k/v projection."""

    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        if n_embd % n_head:
            raise UsageError(f"remat: n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, is_causal=mask is None)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class _MLP(nn.Module):
    """Linear to 4x width, GELU (tanh approximation, as GPT-2), Linear back."""

    def __init__(self, n_embd, dropout):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: attention and MLP, each residual. One stage."""

    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = _CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = _MLP(n_embd, dropout)

    @stage
    def forward(self, x, mask=None):
        """Args:
            x: activations (batch, time, n_embd); the stage's activation.
            mask: None for causal attention, or a boolean (batch, 1, time,
                time) mask, True where a position may attend (a side input).
        """
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT-2-style language model whose blocks form one remat chain.

    Args:
        n_layer: number of blocks.
        n_head: attention heads per block.
        n_embd: width of the residual stream.
        vocab_size: number of tokens.
        block_size: longest sequence (number of position embeddings).
        dropout: dropout on embeddings, attention weights and residual branches.
        tied: share the head's weight with the token embedding.
        budget: activation memory for the chain (see ``remat.chain``), or
            None to run as plain PyTorch. ``model.budget`` and
            ``model.algorithm`` (default "optimal") may be changed later.

    Example:
        >>> import torch
        >>> from remat.models import GPT
        >>> model = GPT(n_layer=2, n_head=2, n_embd=16, vocab_size=50, block_size=8)
        >>> model(torch.randint(0, 50, (3, 8))).shape
        torch.Size([3, 8, 50])
    """

    def __init__(self, n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024, dropout=0.1,
                 tied=True, budget=None):
        super().__init__()
        self.budget = budget
        self.algorithm = "optimal"
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(dropout),
            h=nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer)),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tied:
            self.lm_head.weight = self.transformer.wte.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        # GPT-2 scales the projections into the residual stream by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def stages(self):
        """The chain's stages in call order: every block."""
        return list(self.transformer.h)

    def forward(self, idx, targets=None, attention_mask=None):
        """Logits for every position, and the loss when ``targets`` is given.

        Args:
            idx: token ids, int64 (batch, time), time <= block_size.
            targets: token ids to predict (batch, time); -1 is ignored.
            attention_mask: optional (batch, time), 1 (or True) for real
                tokens and 0 for padding, which no position attends to.

        Returns:
            logits (batch, time, vocab_size), or (logits, loss).
        """
        b, t = idx.shape
        if t > self.block_size:
            raise UsageError(f"remat: sequence of length {t} is longer than block_size {self.block_size}")
        pos = torch.arange(t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        mask = None if attention_mask is None else _attention_mask(attention_mask, t)
        with open_chain(self):
            for block in self.stages():
                x = block(x, mask)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss


def _attention_mask(attention_mask, t):
    """Boolean (batch, 1, t, t) mask: causal, no padded keys, but always the
    position itself, so that a padded query never has every key masked (which
    would make its attention NaN)."""
    keep = attention_mask.to(torch.bool)[:, None, None, :]
    causal = torch.ones(t, t, dtype=torch.bool, device=keep.device).tril()
    diag = torch.eye(t, dtype=torch.bool, device=keep.device)
    return (causal & keep) | diag


def gpt2(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024, dropout=0.1, tied=True,
         budget=None):
    """GPT-2 small by default (124.4M parameters with tied embeddings); the
    arguments give other sizes (e.g. n_layer=24, n_head=16, n_embd=1024 for
    GPT-2 medium)."""
    return GPT(n_layer, n_head, n_embd, vocab_size, block_size, dropout, tied, budget)
