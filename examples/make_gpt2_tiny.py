"""Write the tiny model config and token-id data that ``examples/gpt2_tiny.toml`` uses.

    python examples/make_gpt2_tiny.py            # → examples/gpt2_tiny/ (config + data)
    gradalg build -c examples/gpt2_tiny.toml

The model is a 2-layer GPT-2 (16-dim embeddings, 64-token vocabulary) saved as a
config only (``save_pretrained`` of the config: the command line builds it with random
weights seeded by ``model.seed``); the data are JSON lines of token ids, sequences of
unequal length (gradalg pads each batch).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

VOCAB = 64


def write_tiny(folder, *, n_train: int = 24, n_queries: int = 4, seed: int = 0) -> Path:
    """Write ``folder/model/config.json``, ``folder/train.jsonl`` and ``folder/queries.jsonl``."""
    from transformers import GPT2Config

    folder = Path(folder)
    (folder / "model").mkdir(parents=True, exist_ok=True)
    GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=2,
               bos_token_id=0, eos_token_id=0).save_pretrained(folder / "model")
    g = torch.Generator().manual_seed(seed)
    for name, n in (("train", n_train), ("queries", n_queries)):
        with open(folder / f"{name}.jsonl", "w") as fh:
            for _ in range(n):
                length = int(torch.randint(5, 13, (1,), generator=g))
                ids = torch.randint(1, VOCAB, (length,), generator=g).tolist()
                fh.write(json.dumps({"input_ids": ids}) + "\n")
    return folder


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "gpt2_tiny"), help="the folder to write")
    args = parser.parse_args()
    print(f"wrote {write_tiny(args.out)}")
