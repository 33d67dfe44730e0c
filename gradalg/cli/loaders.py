"""What a config names, made real: the model, the task, the datasets and the projector.

* model: ``transformers`` class + config (random init after ``torch.manual_seed``) or a
  local ``from_pretrained`` folder, or an importable ``module:function``; put in eval
  mode (dropout off: per-example gradients must not depend on a random mask), cast to
  ``dtype`` and moved to ``device``;
* data: a JSON-lines or parquet file of token ids (one example per row) or of text
  tokenized with a local tokenizer, a folder saved by ``datasets``' ``save_to_disk``,
  or an importable function returning a map-style Dataset. Items are dicts of int64
  tensors (``input_ids``, and ``attention_mask`` / ``labels`` / ``token_type_ids`` when
  present); gradalg pads them per batch (``ga.collate.pad_collate``);
* :class:`PlanningData`: a stand-in of ``n`` examples of ``seq_len`` tokens, for
  ``gradalg explain`` (which must read no data).

Every failure to find or read something raises :class:`ConfigError` naming the field
and the path.
"""
from __future__ import annotations

from collections.abc import Mapping
import hashlib
import importlib
import json
import logging
from pathlib import Path

import torch

from .config import Config, ConfigError, DataSection

__all__ = ["import_object", "load_model", "make_task", "load_data", "PlanningData", "TokenDataset", "make_projector",
           "planning_data"]

log = logging.getLogger("gradalg.cli")

TOKEN_FIELDS = ("input_ids", "attention_mask", "labels", "token_type_ids")


def import_object(spec: str, field: str):
    """``"package.module:name"`` → the object (ConfigError naming ``field`` if not found)."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"{field} = {spec!r}: cannot import module {module_name!r} ({err}); check the name "
                          "and that its folder is on PYTHONPATH") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{field} = {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


# ------------------------------------------------------------------------------- model
def _model_class(name: str):
    if ":" in name:
        return import_object(name, "model.class")
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"model.class = {name!r} is a transformers class: pip install 'gradalg[hf]'") from None
    cls = getattr(transformers, name, None)
    if cls is None:
        raise ConfigError(f"model.class = {name!r}: transformers has no class of that name (for example "
                          "'GPT2LMHeadModel', 'LlamaForCausalLM'); or write 'module:Class'")
    return cls


def _hf_config(cls, value, cfg: Config):
    config_class = getattr(cls, "config_class", None)
    if config_class is None:
        raise ConfigError(f"model.class {cls.__name__} has no config_class: use model.factory instead")
    if isinstance(value, dict):
        try:
            return config_class(**value)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"model.config: {config_class.__name__} refused these fields: {err}") from None
    path = Path(cfg.resolve(value))
    if not path.exists():
        raise ConfigError(f"model.config = {value!r}: no such file or folder ({path}); give a folder holding "
                          "config.json (save_pretrained), a JSON file, or an inline table")
    try:
        if path.is_dir():
            return config_class.from_pretrained(str(path), local_files_only=True)
        return config_class.from_json_file(str(path))
    except (OSError, ValueError) as err:
        raise ConfigError(f"model.config = {value!r}: cannot read a {config_class.__name__} from {path}: {err}") from None


def load_model(cfg: Config, *, meta: bool = False) -> torch.nn.Module:
    """The config's model, in eval mode, with its dtype and device.

    meta : build a transformers model on the ``meta`` device (shapes only: no memory, no
        weights read; a checkpoint contributes its config.json) — what ``gradalg explain``
        plans with. A factory model is built as usual.
    """
    m = cfg.model
    if m is None:
        raise ConfigError(f"{cfg.source}: [model] is missing")
    torch.manual_seed(m.seed)
    if meta and m.factory is None:
        cls = _model_class(m.class_)
        config = _hf_config(cls, m.config if m.config is not None else m.checkpoint, cfg)
        with torch.device("meta"):
            model = cls(config)
        if m.dtype is not None:
            model = model.to(getattr(torch, m.dtype))
        return model.eval()
    if m.factory is not None:
        model = import_object(m.factory, "model.factory")(**m.kwargs)
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model.factory = {m.factory!r} returned {type(model).__name__}, not a torch.nn.Module")
    else:
        cls = _model_class(m.class_)
        if m.checkpoint is not None:
            path = Path(cfg.resolve(m.checkpoint))
            if not path.is_dir():
                raise ConfigError(f"model.checkpoint = {m.checkpoint!r}: no folder at {path} (a local folder "
                                  "written by save_pretrained; nothing is downloaded)")
            try:
                model = cls.from_pretrained(str(path), local_files_only=True, **m.kwargs)
            except (OSError, ValueError) as err:
                raise ConfigError(f"model.checkpoint = {m.checkpoint!r}: {cls.__name__}.from_pretrained "
                                  f"failed: {err}") from None
        else:
            model = cls(_hf_config(cls, m.config, cfg))
    if m.dtype is not None:
        model = model.to(getattr(torch, m.dtype))
    try:
        model = model.to(m.device)
    except (RuntimeError, AssertionError) as err:
        raise ConfigError(f"model.device = {m.device!r}: {err}") from None
    model.eval()
    return model


def make_task(cfg: Config, model):
    """``ga.tasks.<kind>(model, **options)`` or an importable task function."""
    from .. import tasks

    kind = cfg.task.kind
    fn = import_object(kind, "task.kind") if ":" in kind else getattr(tasks, kind)
    try:
        return fn(model, **cfg.task.options)
    except TypeError as err:
        raise ConfigError(f"task.options: {kind} refused them: {err}") from None


def make_projector(cfg: Config):
    """The ``[projector]`` as a ``ga.proj`` Projector, or None (no table, or kind = "none")."""
    from .. import proj

    p = cfg.projector
    if p is None or p.kind == "none":
        return None
    try:
        return getattr(proj, p.kind)(p.k, p.seed, **p.options)
    except TypeError as err:
        raise ConfigError(f"projector.options: ga.proj.{p.kind} refused them: {err}") from None


# -------------------------------------------------------------------------------- data
class TokenDataset(torch.utils.data.Dataset):
    """Examples as dicts of int64 tensors, from records (dicts of lists of token ids).

    Records without an ``attention_mask`` get one of ones (every token of a record is
    real), so the padding of a batch is never counted in a sequence's loss.

    Its fingerprint (gradalg's identity of the data) is the digest of the source file(s)
    and the options that shape the examples, not of the records themselves.
    """

    def __init__(self, records, fields, *, max_length=None, name: str = "", key: str = ""):
        self.records = records
        self.fields = tuple(fields)
        self.max_length = max_length
        self.name = name
        self.key = key

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i):
        rec = self.records[i]
        out = {}
        for f in self.fields:
            values = _token_column(rec, f, i, self.name)
            if self.max_length is not None:
                values = values[:self.max_length]
            out[f] = torch.as_tensor(values, dtype=torch.long)
        if "input_ids" in out and "attention_mask" not in out:
            # every token of the record is real: the mask keeps the padding of a batch out of the loss
            out["attention_mask"] = torch.ones_like(out["input_ids"])
        return out

    def __gradalg_fingerprint__(self):
        return ("TokenDataset", self.key, self.fields, self.max_length, len(self.records))

    def __repr__(self) -> str:
        return f"TokenDataset({self.name!r}, n={len(self)}, fields={list(self.fields)})"


def _token_column(rec, field: str, i: int, name: str) -> list:
    """Record ``i``'s column ``field`` as a list of ints, or a DataError naming the record
    (a float would be truncated silently, a string or a nested list cannot be a token id)."""
    from ..errors import DataError

    if not isinstance(rec, Mapping) or field not in rec:
        has = sorted(rec) if isinstance(rec, Mapping) else type(rec).__name__
        raise DataError(f"{name}: example {i} has no column {field!r} (it has {has}): give every example "
                        "the same columns")
    values = rec[field]
    values = values.tolist() if hasattr(values, "tolist") else values
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                        for v in values):
        raise DataError(f"{name}: example {i}'s {field!r} is not a list of integer token ids ({str(values)[:80]}): "
                        "store token ids as ints (tokenize first, or set text = '<column>' with a tokenizer)")
    return values


def _file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=12)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def _format(section: DataSection, path: Path) -> str:
    if section.format is not None:
        return section.format
    if path.is_dir():
        return "hf_disk"
    if path.suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if path.suffix == ".parquet":
        return "parquet"
    raise ConfigError(f"data: cannot tell the format of {path} from its name: set format = 'jsonl', "
                      "'parquet' or 'hf_disk'")


def _records(section: DataSection, path: Path, where: str):
    fmt = _format(section, path)
    if fmt == "jsonl":
        records = []
        with open(path) as fh:
            for line_no, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except ValueError as err:
                        raise ConfigError(f"{where}.path: {path} line {line_no} is not JSON ({err})") from None
        return records
    if fmt == "parquet":
        import pyarrow.parquet as pq
        return pq.read_table(path).to_pylist()
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{where}.path is a datasets folder: pip install datasets") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(f"{where}.path: {path} is not a folder saved by datasets' save_to_disk ({err})") from None
    if isinstance(ds, datasets.DatasetDict):
        if section.split is None:
            raise ConfigError(f"{where}.path: {path} holds splits {list(ds)}: set {where}.split")
        ds = ds[section.split]
    return ds


def _load_tokenizer(cfg: Config, section: DataSection, where: str):
    from transformers import AutoTokenizer

    tok_path = Path(cfg.resolve(section.tokenizer))
    try:
        return AutoTokenizer.from_pretrained(str(tok_path), local_files_only=True)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{where}.tokenizer = {section.tokenizer!r}: cannot load a tokenizer from {tok_path} "
                          f"({err})") from None


def _tokenized(section: DataSection, cfg: Config, records, where: str):
    tok_path = Path(cfg.resolve(section.tokenizer))
    tokenizer = _load_tokenizer(cfg, section, where)
    out = []
    for i, rec in enumerate(records):
        if section.text not in rec:
            raise ConfigError(f"{where}.text = {section.text!r}: example {i} has no such column (it has "
                              f"{sorted(rec)})")
        enc = tokenizer(rec[section.text], truncation=section.max_length is not None, max_length=section.max_length)
        item = {"input_ids": list(enc["input_ids"]), "attention_mask": list(enc["attention_mask"])}
        if section.id_column is not None:
            item[section.id_column] = rec.get(section.id_column)
        out.append(item)
    return out, _file_digest(tok_path)


def _fields(section: DataSection, first: dict, where: str) -> tuple[str, ...]:
    wanted = section.columns
    missing = [c for c in wanted if c not in first]
    if missing:
        raise ConfigError(f"{where}.columns: the examples have no column {missing} (they have {sorted(first)}); "
                          "set columns to the token-id columns, or text = '<column>' with a tokenizer")
    extra = [f for f in TOKEN_FIELDS if f in first and f not in wanted]
    if extra:
        log.debug("%s: columns %s are present but not in %s.columns: not used", where, extra, where)
    return tuple(wanted)


def load_data(cfg: Config, which: str):
    """``(dataset, ids)`` of ``[data.<which>]``: ids are None (0..n-1) or the id column."""
    section = getattr(cfg.data, which)
    where = f"data.{which}"
    if section is None:
        raise ConfigError(f"{cfg.source}: [{where}] is missing")
    if section.function is not None:
        data = import_object(section.function, f"{where}.function")(**section.kwargs)
        if section.limit is not None:
            data = torch.utils.data.Subset(data, range(min(section.limit, len(data))))
        _check_n(section, len(data), where)
        return data, None
    path, records = _file_records(cfg, section, where)
    key = _file_digest(path)
    if section.text is not None:
        records, tok_key = _tokenized(section, cfg, records, where)
        key = f"{key}-{tok_key}-{section.text}"
        fields = ("input_ids", "attention_mask")
    else:
        fields = _fields(section, records[0], where)
    ids = None
    if section.id_column is not None:
        first = records[0]
        if section.id_column not in first:
            raise ConfigError(f"{where}.id_column = {section.id_column!r}: the examples have no such column")
        ids = [r[section.id_column] for r in records]
    _check_n(section, len(records), where)
    return TokenDataset(records, fields, max_length=section.max_length, name=str(path), key=key), ids


def prompt_data(cfg: Config, which: str, task):
    """``(items, ids)`` of a ``[data.<which>]`` with a ``prompt`` column: one query item per
    record, the prompt followed by its completion (the ``completion`` column, else generated
    greedily by the task's model, at most ``max_new_tokens``), whose loss counts only the
    completion's tokens (:func:`gradalg.tasks.queries_from_prompts`)."""
    import gradalg as ga

    section = getattr(cfg.data, which)
    where = f"data.{which}"
    if section.path is None:
        raise ConfigError(f"{where}.prompt reads a file: give {where}.path (a .jsonl / .parquet file or a "
                          "datasets folder with a prompt column)")
    _, records = _file_records(cfg, section, where)
    prompts = _text_column(records, section.prompt, f"{where}.prompt")
    completions = None if section.completion is None else _text_column(records, section.completion,
                                                                         f"{where}.completion")
    tokenizer = _load_tokenizer(cfg, section, where)
    items = ga.tasks.queries_from_prompts(task, prompts, completions, tokenizer=tokenizer,
                                          max_new_tokens=section.max_new_tokens)
    ids = None if section.id_column is None else [_column(r, section.id_column, i, where) for i, r in enumerate(records)]
    _check_n(section, len(items), where)
    return items, ids


def _file_records(cfg: Config, section: DataSection, where: str):
    """``(path, records)`` of a section's file: checked to exist, cut to ``limit``, not empty."""
    path = Path(cfg.resolve(section.path))
    if not path.exists():
        raise ConfigError(f"{where}.path = {section.path!r}: no such file or folder ({path})")
    records = _records(section, path, where)
    if section.limit is not None:
        records = records.select(range(min(section.limit, len(records)))) if hasattr(records, "select") \
            else records[:section.limit]
    if len(records) == 0:
        raise ConfigError(f"{where}.path: {path} has no examples")
    return path, records


def _column(rec, name: str, i: int, where: str):
    if name not in rec:
        raise ConfigError(f"{where}: example {i} has no column {name!r} (it has {sorted(rec)})")
    return rec[name]


def _text_column(records, name: str, where: str) -> list[str]:
    out = []
    for i, rec in enumerate(records):
        value = _column(rec, name, i, where)
        if not isinstance(value, str):
            raise ConfigError(f"{where} = {name!r}: example {i} holds a {type(value).__name__}, not text")
        out.append(value)
    return out


def _check_n(section: DataSection, n: int, where: str) -> None:
    if section.n is not None and section.n != n:
        raise ConfigError(f"{where}.n = {section.n}, but the data have {n} examples: correct n (used by "
                          "`gradalg explain`) or remove it")


class PlanningData(torch.utils.data.Dataset):
    """``n`` examples of ``seq_len`` zero token ids: shapes for a plan, no file opened."""

    def __init__(self, n: int, seq_len: int, fields=("input_ids", "attention_mask")):
        self.n, self.seq_len, self.fields = n, seq_len, tuple(fields)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {f: (torch.ones if f == "attention_mask" else torch.zeros)(self.seq_len, dtype=torch.long)
                for f in self.fields}

    def __gradalg_fingerprint__(self):
        return ("PlanningData", self.n, self.seq_len, self.fields)


def planning_data(cfg: Config, which: str):
    """The stand-in of ``[data.<which>]`` for a plan: no file is opened when ``n`` is set
    (a function is called: it should return a lazy Dataset)."""
    section = getattr(cfg.data, which)
    where = f"data.{which}"
    if section is None:
        raise ConfigError(f"{cfg.source}: [{where}] is missing")
    if section.function is not None:
        return load_data(cfg, which)
    if section.n is None:
        raise ConfigError(f"{where}.n is not set: `gradalg explain` reads no data, so it needs the number of "
                          f"examples (set {where}.n, and {where}.seq_len for the tokens per example)")
    seq_len = section.seq_len or section.max_length or 128
    fields = ("input_ids", "attention_mask", "labels") if section.prompt is not None else \
        ("input_ids", "attention_mask") if section.text is not None else \
        tuple(dict.fromkeys(list(section.columns) + (["attention_mask"] if "input_ids" in section.columns else [])))
    return PlanningData(section.n, seq_len, fields), None
