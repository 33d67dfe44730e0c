"""Small models and data shared by the tests (built from configs: nothing is downloaded)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import gradalg as ga


def mlp(d_in=8, hidden=16, classes=3, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, classes)).to(dtype)


def classification_data(n=40, d_in=8, classes=3, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=g, dtype=dtype), torch.randint(0, classes, (n,), generator=g)


class SmallCNN(nn.Module):
    """Conv2d (bias) -> ReLU -> Conv2d (no bias, stride 2, padding 1) -> Linear."""

    def __init__(self, classes=3):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3)
        self.conv2 = nn.Conv2d(4, 5, 3, stride=2, padding=1, bias=False)
        self.fc = nn.Linear(5 * 2 * 2, classes)

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        return self.fc(x.flatten(1))


def cnn(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return SmallCNN().to(dtype)


def image_data(n=12, dtype=torch.float64, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 6, 6, generator=g, dtype=dtype), torch.randint(0, 3, (n,), generator=g)


def gpt2(dtype=torch.float64, seed=0, n_layer=2, n_embd=64, vocab=101, tied=False):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=vocab, n_positions=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).to(dtype)
    model.eval()
    return model


def padded_token_data(n=6, vocab=101, min_len=3, max_len=9, seed=3):
    """Variable-length sequences right-padded to max_len: (input_ids, attention_mask)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g)
    ids = torch.randint(1, vocab, (n, max_len), generator=g)
    mask = torch.arange(max_len)[None, :] < lengths[:, None]
    ids = ids.masked_fill(~mask, 0)
    return ids, mask.long()


def lm_loss(model, batch):
    """Per-sequence mean token cross-entropy, summed over sequences (padding ignored)."""
    ids, mask = batch
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    tok = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none", ignore_index=-100)
    per_seq = tok.sum(1) / mask[:, 1:].sum(1).clamp_min(1)
    return per_seq.sum()


def lm_task(model):
    return ga.Task(model, lm_loss, token_mask=lambda batch: batch[1].bool(), name="gpt2")
