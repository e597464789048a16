"""Job specs: what to decode, with which model and method, where to write it, on what resources.

A spec is a TOML file (see examples/correct.toml) plus command-line overrides:

    kind = "correct"                      # correct | translate | distill
    model = "../models/gec-base"
    [input]   path = "data/gec-sample"  text_column = "src"  id_column = "id"
    [output]  dir = "../out/gec-sample"
    [decode]  method = "iad"  draft_cap = 16  max_batch_size = 64  max_tokens = 4096
    [batching] rows_per_task = 512
    [resources] actors = 0  gpus_per_actor = 1  cpus_per_actor = 0.25
    [distill] keep_scores = false  max_len_ratio = 3.0  tsv = true   # kind distill only

Paths written in the TOML file are relative to the file's directory; paths given on the command
line (`--set input.path=...`, `--input`, `--output`, `--model`) are relative to the current
directory. Both are stored absolute. Every error names the field at fault
("decode.method: must be one of greedy, beam, iad, ...; got 'foo'").

[decode] is the decoding method's options class itself (aggdec.decoding.methods): `method` plus
any option of any method; options of other methods than the chosen one are ignored (and listed in
`unused_options`), so a spec can switch methods with `--set decode.method=...`.

All three kinds run the same pipeline (one output row per input row); the kind is recorded in the
manifest and picks the default decode method: correct -> iad (output mostly copies the input),
translate and distill -> greedy. Distill jobs also filter pairs and write a training TSV per shard
([distill], see DistillSpec and aggdec.distill).
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aggdec.decoding.method_options import GreedyOptions, options_from_mapping, to_mapping
from aggdec.decoding.options import DecodeOptions, OptionError, coerce, type_hints
from aggdec.distill import PairFilter

KINDS = ("correct", "translate", "distill")
DEFAULT_METHOD = {"correct": "iad", "translate": "greedy", "distill": "greedy"}


class SpecError(ValueError):
    """An invalid job spec or input; the message names the field, file or column at fault."""


@dataclass
class InputSpec:
    path: str = ""
    """A Parquet file, a directory (its *.parquet files; hidden ones, starting with '_' or '.', are
    skipped with a warning naming them, as Parquet readers skip them), or a glob (every file it
    matches, hidden ones too); a local or mounted path, or a URI of any pyarrow file system (s3://,
    gs://, abfs://, hdfs://). A hidden input file's output gets the prefix `hidden-`."""
    text_column: str = "src"
    """The column to decode; must be a string column in every input file."""
    id_column: str | None = None
    """Column holding row ids (string or integer; written as string). None: ids are "<file stem>:<row>"."""
    duplicate_ids: str = "warn"
    """Ids that occur more than once across the inputs: "warn" (before the job starts), "error" (refuse
    the job) or "ignore" (do not read the ids to look)."""


@dataclass
class OutputSpec:
    dir: str = ""
    """Output location (a path every node can write, or a URI as input.path): one <unit>.parquet per
    commit unit (jobs.units), _SUCCESS.<unit> records, _manifest.json."""


@dataclass
class BatchingSpec:
    rows_per_task: int = 4096
    """Rows per commit unit: a file with more rows is cut into units of this many rows, each one task
    of an actor, committed on its own (jobs.units). Keep it several times decode.max_batch_size."""
    pack_rows: int = 256
    """Consecutive files of fewer rows than this each are packed into one commit unit of at most this
    many rows (`<first stem>.pack-<files>`; jobs.units), so that thousands of small shards do not cost a
    task and a commit each; 0: one unit per file."""


@dataclass
class ResourcesSpec:
    actors: int = 0
    """Decode actors. 0: as many as the nodes hold (one per GPU when actors take GPUs, else one per
    cpus_per_actor CPUs). Never more than the units a run has to decode."""
    gpus_per_actor: float | None = None
    """GPUs per actor (the model then runs on cuda). None: 1 where the cluster has GPUs (one actor per
    GPU), else CPU decoding. 0: CPU decoding on any cluster."""
    cpus_per_actor: float | None = None
    """CPUs each actor reserves on its node. None: 1 with GPUs, torch_threads on CPU."""
    torch_threads: int | None = None
    """torch.set_num_threads in each actor. None: 1."""
    max_restarts: int = 0
    """Times Ray restarts a dead actor in place (Ray actor max_restarts). 0: a lost actor ends the
    pipeline run and the driver runs the units that did not commit again (max_attempts)."""
    max_task_retries: int = 0
    """Times a unit whose actor died is retried on the restarted actor (Ray max_task_retries)."""
    max_attempts: int = 3
    """Pipeline runs: after lost actors or nodes, the units that did not commit run again on a fresh
    actor pool on the nodes left, up to this many runs in all."""


@dataclass
class DistillSpec(PairFilter):
    """Seq-KD corpus options (kind distill only): the pair filter (aggdec.distill.PairFilter) plus what
    to store. The n best beam hypotheses are stored when decode.nbest > 1 (method beam)."""

    keep_scores: bool = False
    """Store the output's score (Parquet column score): beam's normalized score, for other methods
    the sum of log-probs incl. eos (one extra teacher-forced verifier pass per batch)."""
    tsv: bool = True
    """Also write <stem>.tsv (header `src<TAB>kd`, one line per kept pair), the format of
    `python -m aggdec.train.heads --data`."""


@dataclass
class JobSpec:
    """A corpus job: decode `input.text_column` of every input row with `model`, write to `output.dir`."""

    kind: str = "correct"
    """correct | translate | distill (recorded in the manifest; picks the default decode method)."""
    model: str = ""
    """Verifier: a project-format model directory (config.json, model.safetensors, tokenizer)."""
    input: InputSpec = field(default_factory=InputSpec)
    output: OutputSpec = field(default_factory=OutputSpec)
    decode: DecodeOptions = field(default_factory=GreedyOptions)
    """The decoding method and its options (aggdec.decoding.methods); `method` defaults to the kind's."""
    batching: BatchingSpec = field(default_factory=BatchingSpec)
    resources: ResourcesSpec = field(default_factory=ResourcesSpec)
    distill: DistillSpec = field(default_factory=DistillSpec)
    unused_options: tuple[str, ...] = ()
    """[decode] options given that belong to other methods than decode.method (ignored); not a TOML key."""
    source: str | None = None
    """The spec file this was loaded from (None: built in code); not a TOML key."""

    @property
    def method(self) -> str:
        return self.decode.method

    @property
    def keep_scores(self) -> bool:
        """Whether decode actors return a score per row (distill.keep_scores of a distill job)."""
        return self.kind == "distill" and self.distill.keep_scores

    @property
    def nbest(self) -> bool:
        """Whether decode actors return the n-best list (decode.nbest > 1, method beam)."""
        return getattr(self.decode, "nbest", 1) > 1

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in NOT_TOML}
        for name, value in out.items():
            if dataclasses.is_dataclass(value):
                out[name] = dataclasses.asdict(value)
        out["decode"] = to_mapping(self.decode)
        return out


NOT_TOML = ("unused_options", "source")
PATH_FIELDS = ("model", "decode.drafter", "input.path", "output.dir")
MOVED = {"drafter": "decode.drafter", "batching.max_batch_size": "decode.max_batch_size",
         "batching.max_tokens": "decode.max_tokens", "distill.nbest": "decode.nbest"}
"""Fields that moved into [decode], where every decoding option now lives."""


def load_spec(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (), *,
              cwd: str | Path | None = None, check_model: bool = True) -> JobSpec:
    """Read a TOML spec (None: start from defaults), apply `key=value` overrides, validate fields.

    Override values are parsed as TOML values when they parse (`8`, `0.5`, `true`, `"x"`), else taken
    as strings (`decode.method=iad`). Input files are not opened here (see jobs.inputs);
    `check_model=False` skips the model directory check (a spec submitted to a cluster).
    """
    cwd = Path(cwd or Path.cwd())
    data: dict[str, Any] = {}
    source = None
    if path is not None:
        p = Path(path)
        if not p.is_absolute():
            p = cwd / p
        if not p.is_file():
            raise SpecError(f"{path}: spec file not found")
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise SpecError(f"{path}: invalid TOML ({e})") from e
        _resolve_paths(data, p.parent)
        source = str(p)
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(data, key, value)
        if key in PATH_FIELDS and isinstance(value, str):
            _resolve_paths(data, cwd, only=key)
    spec = from_dict(data)
    spec.source = source
    validate_fields(spec, check_model=check_model)
    return spec


def parse_override(item: str) -> tuple[str, Any]:
    """'decode.draft_cap=8' -> ('decode.draft_cap', 8); a value that is not TOML stays a string."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise SpecError(f"--set {item!r}: expected KEY=VALUE, e.g. decode.method=iad")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value


def _set_dotted(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise SpecError(f"{key}: {part} is not a section")
    node[parts[-1]] = value


def _resolve_paths(data: dict, base: Path, only: str | None = None) -> None:
    for key in PATH_FIELDS if only is None else (only,):
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get(leaf), str) and node[leaf]:
            node[leaf] = _absolute(node[leaf], base)


def _absolute(value: str, base: Path) -> str:
    if "://" in value:
        return value
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def from_dict(data: dict) -> JobSpec:
    """Build a JobSpec from nested dicts, checking names and types; errors name the dotted field."""
    for old, new in MOVED.items():
        section, _, leaf = old.rpartition(".")
        node = data.get(section) if section else data
        if isinstance(node, dict) and leaf in node:
            raise SpecError(f"{old}: moved to {new} (every decoding option is in [decode])")
    decode = data.get("decode", {})
    if not isinstance(decode, dict):
        raise SpecError(f"decode: must be a table/section, got {type(decode).__name__}")
    spec = _build(JobSpec, {k: v for k, v in data.items() if k != "decode"}, prefix="", skip={"decode", *NOT_TOML})
    if spec.kind not in KINDS:
        raise SpecError(f"kind: must be one of {', '.join(KINDS)}; got {spec.kind!r}")
    try:
        spec.decode, unused = options_from_mapping(decode, DEFAULT_METHOD[spec.kind])
    except OptionError as e:
        raise SpecError(f"decode.{e}") from e
    spec.unused_options = tuple(unused)
    return spec


def _build(cls, data: Any, prefix: str, skip: set[str] = frozenset()):
    if not isinstance(data, dict):
        raise SpecError(f"{prefix.rstrip('.')}: must be a table/section, got {type(data).__name__}")
    hints = type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)} - skip
    unknown = sorted(set(data) - known)
    if unknown:
        raise SpecError(f"{prefix}{unknown[0]}: unknown field; known: {', '.join(sorted(known))}")
    kwargs = {}
    for name in known & set(data):
        typ = hints[name]
        if dataclasses.is_dataclass(typ):
            kwargs[name] = _build(typ, data[name], f"{prefix}{name}.")
        else:
            try:
                kwargs[name] = coerce(f"{prefix}{name}", data[name], typ)
            except OptionError as e:
                raise SpecError(str(e)) from e
    return cls(**kwargs)


def validate_fields(spec: JobSpec, *, check_model: bool = True) -> None:
    """Check values that need no file access beyond the model directory; raise SpecError naming the field.

    Decoding options were validated when [decode] was read (aggdec.decoding.options)."""
    _at_least("batching.rows_per_task", spec.batching.rows_per_task, 1)
    _at_least("batching.pack_rows", spec.batching.pack_rows, 0)
    r = spec.resources
    _at_least("resources.actors", r.actors, 0)
    _at_least("resources.gpus_per_actor", r.gpus_per_actor, 0)
    _at_least("resources.torch_threads", r.torch_threads, 1)
    _at_least("resources.max_restarts", r.max_restarts, -1)
    _at_least("resources.max_task_retries", r.max_task_retries, -1)
    _at_least("resources.max_attempts", r.max_attempts, 1)
    if r.cpus_per_actor is not None and r.cpus_per_actor <= 0:
        raise SpecError(f"resources.cpus_per_actor: must be > 0, got {r.cpus_per_actor}")
    if spec.input.duplicate_ids not in ("warn", "error", "ignore"):
        raise SpecError(f"input.duplicate_ids: must be one of warn, error, ignore; got {spec.input.duplicate_ids!r}")
    if not spec.input.text_column:
        raise SpecError("input.text_column: must not be empty")
    if spec.input.id_column == spec.input.text_column:
        raise SpecError(f"input.id_column: must differ from input.text_column ({spec.input.text_column!r})")
    if not spec.input.path:
        raise SpecError("input.path: required (a Parquet file, directory or glob)")
    if not spec.output.dir:
        raise SpecError("output.dir: required")
    if not spec.model:
        raise SpecError("model: required (a model directory)")
    if check_model and not (Path(spec.model) / "config.json").is_file():
        raise SpecError(f"model: {spec.model} is not a model directory (no config.json)")
    drafter = getattr(spec.decode, "drafter", None)
    if check_model and drafter is not None and not any(
            (Path(drafter) / name).is_file() for name in ("config.json", "heads.safetensors")):
        raise SpecError(f"decode.drafter: {drafter} is neither a model directory (config.json) nor proposal heads "
                        "(heads.safetensors)")
    _validate_distill(spec)


def _validate_distill(spec: JobSpec) -> None:
    d = spec.distill
    if spec.kind != "distill" and d != DistillSpec():
        raise SpecError(f"distill: only applies to kind = \"distill\"; this job's kind is {spec.kind!r}")
    if spec.kind == "distill" and "nbest" in spec.unused_options:
        raise SpecError(f"decode.nbest: needs decode.method = \"beam\", got {spec.method!r}")
    for name in ("min_len_ratio", "max_len_ratio"):
        value = getattr(d, name)
        if value is not None and not 0 <= value < float("inf"):
            raise SpecError(f"distill.{name}: must be a finite number >= 0 or unset, got {value}")
    if d.min_len_ratio is not None and d.max_len_ratio is not None and d.min_len_ratio > d.max_len_ratio:
        raise SpecError(f"distill.min_len_ratio: {d.min_len_ratio} is above distill.max_len_ratio ({d.max_len_ratio})")


def _at_least(name: str, value: float | None, low: float) -> None:
    if value is not None and value < low:
        raise SpecError(f"{name}: must be >= {low}, got {value}")
