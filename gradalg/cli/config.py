"""The configuration schema of the ``gradalg`` command line, validated by pydantic.

A config is a TOML (``tomllib``) or YAML file; every table below is a pydantic model
that forbids unknown keys, so a typo is reported with its place and the fields that
exist (:class:`ConfigError`). Relative paths are relative to the config file's folder.

.. code-block:: toml

    layers = ["transformer.h.*.mlp.c_fc"]      # optional: default layers of ga.grads

    [model]                                    # exactly one of config / checkpoint / factory
    class = "GPT2LMHeadModel"                  # a transformers class, or "module:Class"
    config = "tiny_gpt2"                       # folder or JSON file (or inline table): random init, seeded
    # checkpoint = "runs/step_1000"            # from_pretrained on a local folder
    # factory = "mypkg.models:build"           # any importable function returning an nn.Module
    seed = 0
    dtype = "float64"

    [task]
    kind = "causal_lm"                         # a ga.tasks function, or "module:function"

    [data.train]                               # and [data.queries]
    path = "data/train.jsonl"                  # .jsonl / .parquet of token ids or text, or an HF datasets folder
    # function = "mypkg.data:train_set"        # or an importable function returning a Dataset

    [projector]
    kind = "kron"
    k = 16

    [store]
    path = "out/train.zarr"

    [query]
    output = "out/scores.csv"
    top_k = 5

    [method]
    name = "logra"
    options = { k = 16 }

    [score]
    output = "out/logra.parquet"

    [options]                                  # ga.options
    batch_size = 8
"""
from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from ..methods import REGISTRY
from .errors import ConfigError

__all__ = ["Config", "ConfigError", "load_config", "ModelSection", "TaskSection", "DataSection",
           "ProjectorSection", "StoreSection", "QuerySection", "MethodSection", "ScoreSection", "ExecutorSection",
           "PROJECTOR_KINDS", "METHODS", "DTYPES"]

PROJECTOR_KINDS = ("gaussian", "rademacher", "kron", "sparse", "tensorsketch", "mask", "grass", "factgrass")
# methods the command line runs: one model, train and queries (tracin / less need checkpoints); a
# method lists itself here with @method(..., cli=True) (gradalg/methods/registry.py)
METHODS = tuple(name for name, entry in REGISTRY.items() if entry.cli)
DTYPES = ("float32", "float64", "bfloat16", "float16")
OUTPUT_SUFFIXES = (".csv", ".parquet", ".zarr")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


def _importable(value: str | None, what: str) -> str | None:
    if value is not None and (value.count(":") != 1 or not all(value.split(":"))):
        raise ConfigError(f"{what} must be 'module:function' (an importable name), got {value!r}")
    return value


class ModelSection(Section):
    """The model: a transformers class built from a config (random init, seeded) or
    loaded from a local checkpoint folder, or any importable factory."""

    class_: str | None = Field(None, alias="class", description="a transformers class name "
                               "('GPT2LMHeadModel') or 'module:Class'")
    config: str | dict[str, Any] | None = Field(None, description="config folder / JSON file, or an inline table "
                                                "of config fields: the model is built with random weights")
    checkpoint: str | None = Field(None, description="a local folder for from_pretrained")
    factory: str | None = Field(None, description="'module:function' returning an nn.Module")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the factory "
                                   "(or of from_pretrained)")
    seed: int = Field(0, description="torch seed before a random init")
    dtype: Literal[DTYPES] | None = Field(None, description="cast the model to this dtype")  # type: ignore[valid-type]
    device: str = Field("cpu", description="torch device of the model ('cpu', 'cuda', 'cuda:1')")

    @field_validator("factory")
    @classmethod
    def _factory(cls, v):
        return _importable(v, "model.factory")

    @model_validator(mode="after")
    def _one_source(self):
        given = [k for k in ("config", "checkpoint", "factory") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ConfigError("give exactly one of model.config (random init), model.checkpoint (a local "
                             f"from_pretrained folder) or model.factory ('module:function'); got {given or 'none'}")
        if self.factory is None and self.class_ is None:
            raise ConfigError(f"model.{given[0]} needs model.class: a transformers class such as "
                             "'GPT2LMHeadModel' (or 'module:Class')")
        return self


class TaskSection(Section):
    """How the model's loss is formed: a ``ga.tasks`` function or an importable one."""

    kind: str = Field("causal_lm", description="causal_lm, masked_lm, seq2seq, sequence_classification, "
                      "classification, or 'module:function' taking the model")
    options: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the task function")

    @field_validator("kind")
    @classmethod
    def _kind(cls, v):
        builtin = ("causal_lm", "masked_lm", "seq2seq", "sequence_classification", "classification")
        if ":" in v:
            return _importable(v, "task.kind")
        if v not in builtin:
            raise ConfigError(f"task.kind must be one of {list(builtin)} or 'module:function', got {v!r}")
        return v


class DataSection(Section):
    """A dataset: a file or folder (``path``), or an importable function."""

    path: str | None = Field(None, description=".jsonl / .json lines or .parquet file, or a folder saved "
                             "by datasets' save_to_disk")
    function: str | None = Field(None, description="'module:function' returning a map-style Dataset")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the function")
    format: Literal["jsonl", "parquet", "hf_disk"] | None = Field(None, description="jsonl, parquet or hf_disk "
                                                                  "(default: from the path)")
    columns: list[str] = Field(default_factory=lambda: ["input_ids"], description="token-id columns kept "
                               "(e.g. input_ids, attention_mask, labels); without attention_mask, one of ones "
                               "is added")
    text: str | None = Field(None, description="a text column, tokenized with `tokenizer` (instead of ids)")
    prompt: str | None = Field(None, description="queries only: a prompt text column; each query is the prompt "
                               "and its completion (the `completion` column, else generated greedily by the "
                               "model), and only the completion's tokens count (ga.tasks.queries_from_prompts)")
    completion: str | None = Field(None, description="with `prompt`: a completion text column (left out: "
                                   "generated)")
    max_new_tokens: int = Field(32, ge=1, description="with `prompt` and no `completion`: the longest generated "
                                "completion, in tokens")
    tokenizer: str | None = Field(None, description="a local tokenizer folder (AutoTokenizer)")
    max_length: int | None = Field(None, ge=1, description="truncate sequences to this many tokens")
    id_column: str | None = Field(None, description="a column holding each example's id (default 0..n-1)")
    split: str | None = Field(None, description="the split of a DatasetDict folder")
    limit: int | None = Field(None, ge=1, description="keep the first `limit` examples")
    n: int | None = Field(None, ge=1, description="number of examples: `gradalg explain` then opens nothing "
                          "(checked against the data by the other commands)")
    seq_len: int | None = Field(None, ge=1, description="tokens per example `gradalg explain` plans for "
                                "(default max_length, else 128)")

    @field_validator("function")
    @classmethod
    def _function(cls, v):
        return _importable(v, "data.function")

    @model_validator(mode="after")
    def _one_source(self):
        if (self.path is None) == (self.function is None):
            raise ConfigError("give exactly one of path (a file or a datasets folder) or function ('module:function')")
        if self.text is not None and self.tokenizer is None:
            raise ConfigError("text needs tokenizer: a local tokenizer folder (saved with save_pretrained)")
        if self.prompt is not None and self.tokenizer is None:
            raise ConfigError("prompt needs tokenizer: a local tokenizer folder (saved with save_pretrained)")
        if self.prompt is not None and self.text is not None:
            raise ConfigError("give one of text (whole documents) or prompt (prompts with completions), not both")
        if self.completion is not None and self.prompt is None:
            raise ConfigError("completion needs prompt: the column of the prompts the completions follow")
        return self


class ProjectorSection(Section):
    """A ``ga.proj`` projector applied to every gradient (``kind = "none"``: no projection)."""

    kind: Literal[PROJECTOR_KINDS + ("none",)] = Field(  # type: ignore[valid-type]
        "kron", description="gaussian, rademacher, kron, sparse, tensorsketch, mask, grass, factgrass, or none")
    k: int = Field(64, ge=1, description="output dimension (per layer for kron, grass, factgrass, mask)")
    seed: int = Field(0, description="the projection's seed (the same numbers on every machine)")
    options: dict[str, Any] = Field(default_factory=dict, description="other arguments of ga.proj.<kind> "
                                    "(per_block, k_in, k_out, s, mask_k)")


class StoreSection(Section):
    """Where ``gradalg build`` writes the projected training gradients."""

    path: str = Field(..., description="a Zarr store folder (…/train.zarr)")
    chunk_rows: int = Field(256, ge=1, description="rows per chunk: the unit of writing and resuming")


class QuerySection(Section):
    """``gradalg query``: queries against the store."""

    output: str = Field(..., description="a .csv, .parquet or .zarr path")
    similarity: Literal["dot", "cos", "influence"] = Field(
        "dot", description="dot: P(Q)·P(G); cos: of normalized rows; influence: P(Q)(F + λI)⁻¹P(G) with F "
        "the Fisher of the stored rows")
    damping: float = Field(1e-3, gt=0, description="λ of similarity = 'influence'")
    top_k: int | None = Field(None, ge=0, description="keep the k highest training scores per query (0: every score)")
    chunk_rows: int = Field(1024, ge=1, description="training columns per chunk of a .zarr output")
    other_checkpoint: bool = Field(False, description="allow a model whose weights differ from the store's: "
                                   "scores of the query gradients at [model] against the training gradients "
                                   "stored at the store's checkpoint (docs/cli.md)")

    @field_validator("output")
    @classmethod
    def _suffix(cls, v):
        return _output(v, "query.output")


class MethodSection(Section):
    """``gradalg score``: a published method, ``ga.methods.<name>``."""

    name: Literal[METHODS] = Field(..., description=", ".join(METHODS[:-1]) + " or " + METHODS[-1])  # type: ignore[valid-type]
    options: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the method "
                                    "(damping, curvature, k, ...)")
    use_projector: bool = Field(True, description="pass [projector] to methods that take one (influence, "
                                "grad_dot, grad_cos, trak, relatif)")


class ScoreSection(Section):
    output: str = Field(..., description="a .csv, .parquet or .zarr path")
    top_k: int | None = Field(None, ge=0, description="keep the k highest training scores per query (0: every score)")
    chunk_rows: int = Field(1024, ge=1, description="training columns per chunk of a .zarr output")

    @field_validator("output")
    @classmethod
    def _suffix(cls, v):
        return _output(v, "score.output")


def _output(value: str, where: str) -> str:
    if not value.endswith(OUTPUT_SUFFIXES):
        raise ConfigError(f"{where} must end in one of {list(OUTPUT_SUFFIXES)} (the format), got {value!r}")
    return value


class ExecutorSection(Section):
    """Where the passes run: this process, or a Dask cluster (``ga.exec.DaskExecutor``)."""

    kind: Literal["local", "dask"] = Field("local", description="local (this process) or dask")
    address: str | None = Field(None, description="a running Dask scheduler ('tcp://host:8786', e.g. started in "
                                "a SLURM job); default: a local cluster of n_workers processes")
    n_workers: int = Field(2, ge=1, description="workers of the local cluster")
    threads_per_worker: int = Field(1, ge=1, description="threads of each worker (and torch threads)")
    options: dict[str, Any] = Field(default_factory=dict, description="other DaskExecutor arguments "
                                    "(shards_per_worker, retries, task_timeout, ...)")


class DataSets(Section):
    train: DataSection | None = None
    queries: DataSection | None = None

    @model_validator(mode="after")
    def _prompts_are_queries(self):
        if self.train is not None and self.train.prompt is not None:
            raise ConfigError("data.train.prompt: prompts with completions are queries; give the training "
                              "documents as token ids or text (data.train.text)")
        return self


class Config(Section):
    """A whole config file (every table optional; each command says which it needs)."""

    layers: list[str] | str | None = Field(None, description="module names or glob patterns, or 'all'")
    objective: Literal["loss", "sampled", "output"] = Field("loss", description="of ga.grads for build / query: "
                                                            "the loss, labels sampled from the model, TRAK's output")
    backend: Literal["hooks", "func"] = Field("hooks", description="ga.grads backend: hooks (factored capture) "
                                              "or func (torch.func, any module)")
    model: ModelSection | None = None
    task: TaskSection = Field(default_factory=TaskSection)
    data: DataSets = Field(default_factory=DataSets)
    projector: ProjectorSection | None = None
    store: StoreSection | None = None
    query: QuerySection | None = None
    method: MethodSection | None = None
    score: ScoreSection | None = None
    executor: ExecutorSection = Field(default_factory=ExecutorSection)
    options: dict[str, Any] = Field(default_factory=dict, description="ga.options (batch_size, memory_budget: "
                                    "bytes, '8GB' = 8·10⁹, '8GiB' = 8·2³⁰, ...)")

    # not part of the file: where it came from (set by load_config)
    _source: str | None = PrivateAttr(None)
    _base_dir: str = PrivateAttr(".")
    _text_digest: str | None = PrivateAttr(None)

    @property
    def source(self) -> str | None:
        """The config file's path."""
        return self._source

    @property
    def base_dir(self) -> str:
        """The folder relative paths are resolved from."""
        return self._base_dir

    @property
    def text_digest(self) -> str | None:
        """sha256 (16 hex digits) of the config file's text."""
        return self._text_digest

    @field_validator("options")
    @classmethod
    def _options(cls, v):
        from ..options import Options
        from dataclasses import fields

        from ..errors import OptionError

        valid = {f.name for f in fields(Options)}
        unknown = sorted(set(v) - valid)
        if unknown:
            raise ConfigError(f"unknown ga.options {unknown}; valid: {sorted(valid)}")
        try:   # values checked when the file is read, as ga.options would ("8GB" = 8·10⁹ bytes)
            Options(**v)
        except OptionError as err:
            raise ConfigError(str(err)) from None
        return v

    def resolve(self, path: str | None) -> str | None:
        """``path`` relative to the config file's folder (absolute paths unchanged)."""
        if path is None:
            return None
        p = Path(path).expanduser()
        return str(p if p.is_absolute() else Path(self.base_dir) / p)

    def require(self, *sections: str, command: str) -> None:
        """Refuse (ConfigError) when a section the command needs is missing."""
        missing = [s for s in sections if _get(self, s) is None]
        if missing:
            raise ConfigError(f"{self.source or 'the config'}: `gradalg {command}` needs "
                              + ", ".join(f"[{s}]" for s in missing)
                              + " (see `gradalg " + command + " --help` for an example)")

    def as_record(self) -> dict:
        """The config as JSON-able data (what results record about their origin)."""
        return json.loads(self.model_dump_json(by_alias=True, exclude_none=True))


def _get(cfg, dotted: str):
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value


def _location(loc) -> str:
    parts = []
    for p in loc:
        if isinstance(p, int):
            parts[-1:] = [f"{parts[-1]}[{p}]"] if parts else [f"[{p}]"]
        elif p in ("function-after", "function-before") or "[" in str(p):
            continue
        else:
            parts.append(str(p))
    return ".".join(parts) or "(top level)"


def _fields_at(loc) -> list[str]:
    """The field names (TOML spelling) of the table at ``loc`` in the schema."""
    import typing

    model = Config
    for part in loc:
        if isinstance(part, int) or model is None:
            continue
        field = next((f for name, f in model.model_fields.items() if (f.alias or name) == part), None)
        if field is None:
            return []
        ann = field.annotation
        candidates = [a for a in typing.get_args(ann) or (ann,) if isinstance(a, type) and issubclass(a, BaseModel)]
        model = candidates[0] if candidates else None
    if model is None:
        return []
    return [f.alias or name for name, f in model.model_fields.items()]


def format_validation_error(err: ValidationError, source: str) -> str:
    """pydantic's errors as one line per field: ``file: field: problem (got value)``."""
    lines = []
    for e in err.errors(include_url=False):
        where = _location(e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        shown = "input" in e and not isinstance(e["input"], dict) and e["type"] not in ("value_error", "missing")
        if e["type"] == "extra_forbidden":
            parent = _location(e["loc"][:-1])
            valid = _fields_at(e["loc"][:-1])
            msg = (f"unknown field (a typo?); {'the top level' if parent == '(top level)' else '[' + parent + ']'} "
                   f"takes {valid}")
            shown = False
        elif e["type"] == "missing":
            msg = "required: add it"
        lines.append(f"  {where}: {msg}" + (f" (got {e['input']!r})" if shown else ""))
    return f"{source}: invalid config ({len(lines)} problem{'s' if len(lines) > 1 else ''}):\n" + "\n".join(lines)


def _read(path: Path) -> tuple[dict, str]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"no config file at {path}: pass --config PATH (a .toml or .yaml file)") from None
    except OSError as err:
        raise ConfigError(f"cannot read the config {path}: {err}") from None
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"{path}: YAML configs need PyYAML (pip install pyyaml), or write it as TOML") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: not valid TOML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a table of sections, got {type(data).__name__}")
    return data, text


def _set_dotted(data: dict, key: str, value) -> None:
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {p} is not a table")
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``"store.chunk_rows=64"`` → ``("store.chunk_rows", 64)`` (the value read as TOML,
    else as a string)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: write KEY=VALUE, e.g. --set store.chunk_rows=64")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip(), value


def load_config(path, overrides: list[str] | None = None) -> Config:
    """Read, apply ``--set KEY=VALUE`` overrides, and validate a config file.

    Raises :class:`ConfigError` naming the file and every field at fault.
    """
    path = Path(path).expanduser()
    data, text = _read(path)
    for item in overrides or []:
        key, value = parse_override(item)
        _set_dotted(data, key, value)
    try:
        cfg = Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, str(path))) from None
    cfg._source = str(path)
    cfg._base_dir = str(path.resolve().parent)
    cfg._text_digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return cfg
