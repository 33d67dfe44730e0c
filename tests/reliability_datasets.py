"""Datasets for the reliability tests, importable from a subprocess."""
from torch.utils.data import Dataset


class ListDataset(Dataset):
    """Examples kept as a Python list of (x, y) pairs: a plain map-style dataset."""

    def __init__(self, X, y):
        self.items = [(X[i], y[i]) for i in range(len(X))]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]
