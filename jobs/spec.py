"""Job specs: what to decode, with which model and method, where to write it, on what resources.

A spec is a TOML file (see examples/correct.toml) plus command-line overrides:

    kind = "correct"                      # correct | translate | distill
    model = "../models/gec-base"
    [input]   path = "data/gec-sample"  text_column = "src"  id_column = "id"
    [output]  dir = "../out/gec-sample"
    [decode]  method = "iad"  draft_cap = 32
    [batching] rows_per_task = 512  max_batch_size = 64  max_tokens = 4096
    [resources] actors = 0  gpus_per_actor = 0  cpus_per_actor = 0.25
    [distill] nbest = 1  keep_scores = false  max_len_ratio = 3.0  tsv = true   # kind distill only

Paths written in the TOML file are relative to the file's directory; paths given on the command
line (`--set input.path=...`, `--input`, `--output`, `--model`) are relative to the current
directory. Both are stored absolute. Every error names the field at fault
("decode.method: must be one of greedy, beam, iad; got 'foo'").

All three kinds run the same pipeline (one output row per input row); the kind is recorded in the
manifest and picks the default decode method: correct -> iad (output mostly copies the input),
translate and distill -> greedy. Distill jobs also filter pairs and write a training TSV per shard
([distill], see DistillSpec and jobs.distill).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aggdec.api import METHODS, NEEDS_DRAFTER, VERIFY_PRECISIONS, DecodeOptions

KINDS = ("correct", "translate", "distill")
DEFAULT_METHOD = {"correct": "iad", "translate": "greedy", "distill": "greedy"}


class SpecError(ValueError):
    """An invalid job spec or input; the message names the field, file or column at fault."""


@dataclass
class InputSpec:
    path: str = ""
    """A Parquet file, a directory (its *.parquet files, not those starting with '_' or '.'), or a glob."""
    text_column: str = "src"
    """The column to decode; must be a string column in every input file."""
    id_column: str | None = None
    """Column holding row ids (string or integer; written as string). None: ids are "<file stem>:<row>"."""


@dataclass
class OutputSpec:
    dir: str = ""
    """Output directory: one <input stem>.parquet per input file, _SUCCESS.<stem> markers, _manifest.json."""


@dataclass
class DecodeSpec:
    """Mirrors aggdec.api.DecodeOptions (batch limits are under [batching], the drafter is top-level)."""

    method: str | None = None
    """One of aggdec.api.METHODS (greedy, beam, iad, gad, gad++, blockwise). None: the kind's default."""
    beam: int = 5
    """Beam size (method beam)."""
    lenpen: float = 1.0
    """Length penalty (method beam)."""
    max_len_a: float = 1.5
    """Output length limit a * src_len + b."""
    max_len_b: int = 10
    """Output length limit a * src_len + b."""
    draft_cap: int | None = None
    """IAD: most draft tokens per row and verifier call (None: the whole remaining input)."""
    adaptive_draft: bool = False
    """IAD: per-row draft cap / GAD: per-row block size that halves on early rejection, doubles on full acceptance."""
    substitution: bool = False
    """IAD: after a rejection with no unique re-alignment, keep copying the input (a substitution guess)."""
    nearest_match: bool = False
    """IAD: after a rejection, where the output's suffix occurs several times in the input, re-align at the
    occurrence nearest the rejected token (a deletion guess)."""
    block_size: int = 10
    """GAD: block size k (masks per verifier call)."""
    top_beta: int = 3
    """GAD++: accept a drafted token within the verifier's top-beta ..."""
    tau: float = 1.0
    """GAD++: ... and within tau of the top log-probability."""
    top_k_accept: int = 1
    """Approximate acceptance: a drafted token within the verifier's top-k is accepted (1: exact, lossless)."""
    min_block: int = 0
    """Blockwise: always keep the first min_block proposals (approximate, lossy; 0: off)."""
    verify_precision: str = "auto"
    """fp32 | bf16-certified | auto: how the verifier's top-1 is computed; outputs are the same either way
    (see aggdec.model.projection). auto: bf16-certified on a CPU with native bf16, else fp32."""


@dataclass
class BatchingSpec:
    rows_per_task: int = 512
    """Rows handed to one actor call (Ray Data batch_size); the engine batches continuously inside it,
    so keep it several times max_batch_size (64-row calls ran 1.6x slower than 512-row calls in
    bench/pipeline_bench.py); smaller values only buy more parallelism across actors."""
    max_batch_size: int = 64
    """Engine: most sentences decoded at once (continuous batching)."""
    max_tokens: int | None = None
    """Engine: most source tokens decoded at once (None: no token budget)."""


@dataclass
class ResourcesSpec:
    actors: int = 0
    """Decode actors. 0: one per GPU when gpus_per_actor > 0, else one single-threaded actor per
    CPU core (at most 8)."""
    gpus_per_actor: float = 0.0
    """GPUs per actor (1 for one actor per GPU; the model then runs on cuda). 0: CPU decoding."""
    cpus_per_actor: float | None = None
    """CPU reservation per actor. None: 1 with GPUs; on CPU a share that leaves >= 1 CPU for reads."""
    torch_threads: int | None = None
    """torch.set_num_threads in each actor. None: cluster CPUs / actors (CPU), at least 1."""
    max_restarts: int = 3
    """Times a dead actor is restarted (Ray actor max_restarts)."""
    max_task_retries: int = 3
    """Times a batch whose actor died is retried (Ray max_task_retries)."""


@dataclass
class DistillSpec:
    """Seq-KD corpus options (kind distill only); see jobs.distill for the filters and the TSV."""

    nbest: int = 1
    """> 1: also store the n best beam hypotheses per row (Parquet column nbest); needs decode.method
    beam with decode.beam >= nbest. The TSV always holds the 1-best."""
    keep_scores: bool = False
    """Store the output's score (Parquet column score): beam's normalized score, for other methods
    the sum of log-probs incl. eos (one extra teacher-forced verifier pass per batch)."""
    min_len_ratio: float | None = None
    """Drop pairs whose hyp/src token-length ratio (both without eos) is below this (None: no limit)."""
    max_len_ratio: float | None = None
    """Drop pairs whose hyp/src token-length ratio is above this (None: no limit)."""
    drop_empty: bool = True
    """Drop pairs with an empty source or output."""
    tsv: bool = True
    """Also write <stem>.tsv (header `src<TAB>kd`, one line per kept pair), the format of
    `python -m aggdec.train.drafter --data`."""


@dataclass
class DebugSpec:
    fail_once_marker: str | None = None
    """Tests only: if set and the file does not exist, the first actor call creates it and kills its process."""


@dataclass
class JobSpec:
    """A corpus job: decode `input.text_column` of every input row with `model`, write to `output.dir`."""

    kind: str = "correct"
    """correct | translate | distill (recorded in the manifest; picks the default decode method)."""
    model: str = ""
    """Verifier: a project-format model directory (config.json, model.safetensors, tokenizer)."""
    drafter: str | None = None
    """Drafter for gad / gad++ (a NAR drafter model directory) or blockwise (a proposal-heads directory)."""
    input: InputSpec = field(default_factory=InputSpec)
    output: OutputSpec = field(default_factory=OutputSpec)
    decode: DecodeSpec = field(default_factory=DecodeSpec)
    batching: BatchingSpec = field(default_factory=BatchingSpec)
    resources: ResourcesSpec = field(default_factory=ResourcesSpec)
    distill: DistillSpec = field(default_factory=DistillSpec)
    debug: DebugSpec = field(default_factory=DebugSpec)
    source: str | None = None
    """The spec file this was loaded from (None: built in code); not a TOML key."""

    @property
    def method(self) -> str:
        return self.decode.method or DEFAULT_METHOD[self.kind]

    @property
    def keep_scores(self) -> bool:
        """Whether decode actors return a score per row (distill.keep_scores of a distill job)."""
        return self.kind == "distill" and self.distill.keep_scores

    def decode_options(self) -> DecodeOptions:
        """The engine options: [decode] plus batching.max_batch_size / max_tokens, the drafter and
        (distill jobs) distill.nbest."""
        fields = dataclasses.asdict(self.decode)
        fields["method"] = self.method
        return DecodeOptions(**fields, max_batch_size=self.batching.max_batch_size,
                             max_tokens=self.batching.max_tokens, drafter=self.drafter,
                             nbest=self.distill.nbest if self.kind == "distill" else 1)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["decode"]["method"] = self.method
        return out


PATH_FIELDS = ("model", "drafter", "input.path", "output.dir", "debug.fail_once_marker")
SECTIONS = {f.name: f.type for f in dataclasses.fields(JobSpec)}


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
    return _build(JobSpec, data, prefix="", skip={"source"})


def _build(cls, data: Any, prefix: str, skip: set[str] = frozenset()):
    if not isinstance(data, dict):
        raise SpecError(f"{prefix.rstrip('.')}: must be a table/section, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
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
            kwargs[name] = _check_type(f"{prefix}{name}", data[name], typ)
    return cls(**kwargs)


def _check_type(name: str, value: Any, typ) -> Any:
    args = typing.get_args(typ)
    optional = isinstance(typ, types.UnionType) and type(None) in args
    base = next((a for a in args if a is not type(None)), typ) if optional else typ
    if optional and value in (None, "none", "None", "null"):
        return None
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if base is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if base is bool and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, base) or (base is not bool and isinstance(value, bool)):
        raise SpecError(f"{name}: must be {base.__name__}{' or none' if optional else ''}, got {value!r}")
    return value


def validate_fields(spec: JobSpec, *, check_model: bool = True) -> None:
    """Check values that need no file access beyond the model directory; raise SpecError naming the field."""
    if spec.kind not in KINDS:
        raise SpecError(f"kind: must be one of {', '.join(KINDS)}; got {spec.kind!r}")
    if spec.decode.method is not None and spec.decode.method not in METHODS:
        raise SpecError(f"decode.method: must be one of {', '.join(METHODS)}; got {spec.decode.method!r}")
    if spec.method == "beam" and importlib.util.find_spec("aggdec.decoding.beam") is None:
        raise SpecError("decode.method: 'beam' needs aggdec/decoding/beam.py, which this install lacks")
    if spec.decode.verify_precision not in VERIFY_PRECISIONS:
        raise SpecError(f"decode.verify_precision: must be one of {', '.join(VERIFY_PRECISIONS)}; "
                        f"got {spec.decode.verify_precision!r}")
    if spec.decode.adaptive_draft and spec.method == "iad" and spec.decode.draft_cap is None:
        raise SpecError("decode.adaptive_draft: with method iad needs decode.draft_cap")
    for name, low in (("beam", 1), ("max_len_b", 0), ("block_size", 1), ("top_beta", 1), ("top_k_accept", 1),
                      ("min_block", 0), ("tau", 0)):
        _at_least(f"decode.{name}", getattr(spec.decode, name), low)
    _at_least("decode.draft_cap", spec.decode.draft_cap, 1)
    _at_least("batching.rows_per_task", spec.batching.rows_per_task, 1)
    _at_least("batching.max_batch_size", spec.batching.max_batch_size, 1)
    _at_least("batching.max_tokens", spec.batching.max_tokens, 1)
    r = spec.resources
    _at_least("resources.actors", r.actors, 0)
    _at_least("resources.gpus_per_actor", r.gpus_per_actor, 0)
    _at_least("resources.torch_threads", r.torch_threads, 1)
    _at_least("resources.max_restarts", r.max_restarts, -1)
    _at_least("resources.max_task_retries", r.max_task_retries, -1)
    if r.cpus_per_actor is not None and r.cpus_per_actor <= 0:
        raise SpecError(f"resources.cpus_per_actor: must be > 0, got {r.cpus_per_actor}")
    if not spec.input.text_column:
        raise SpecError("input.text_column: must not be empty")
    if spec.input.id_column == spec.input.text_column:
        raise SpecError(f"input.id_column: must differ from input.text_column ({spec.input.text_column!r})")
    if not spec.input.path:
        raise SpecError("input.path: required (a Parquet file, directory or glob)")
    if not spec.output.dir:
        raise SpecError("output.dir: required")
    if "://" in spec.output.dir:
        raise SpecError(f"output.dir: must be a local or mounted path (the driver commits files), got {spec.output.dir!r}")
    if not spec.model:
        raise SpecError("model: required (a model directory)")
    if check_model and not (Path(spec.model) / "config.json").is_file():
        raise SpecError(f"model: {spec.model} is not a model directory (no config.json)")
    if check_model and spec.drafter is not None and not any(
            (Path(spec.drafter) / name).is_file() for name in ("config.json", "heads.safetensors")):
        raise SpecError(f"drafter: {spec.drafter} is neither a model directory (config.json) nor proposal heads "
                        "(heads.safetensors)")
    if spec.method in NEEDS_DRAFTER and not spec.drafter:
        raise SpecError(f"drafter: decode.method {spec.method!r} needs a drafter (a NAR drafter or proposal-heads directory)")
    _validate_distill(spec)
    try:
        spec.decode_options()
    except ValueError as e:  # anything DecodeOptions checks that is not checked above
        raise SpecError(f"decode: {e}") from e


def _validate_distill(spec: JobSpec) -> None:
    d = spec.distill
    if spec.kind != "distill" and d != DistillSpec():
        raise SpecError(f"distill: only applies to kind = \"distill\"; this job's kind is {spec.kind!r}")
    _at_least("distill.nbest", d.nbest, 1)
    if d.nbest > 1 and spec.method != "beam":
        raise SpecError(f"distill.nbest: {d.nbest} needs decode.method = \"beam\", got {spec.method!r}")
    if d.nbest > spec.decode.beam:
        raise SpecError(f"distill.nbest: must be <= decode.beam ({spec.decode.beam}), got {d.nbest}")
    for name in ("min_len_ratio", "max_len_ratio"):
        value = getattr(d, name)
        if value is not None and not 0 <= value < float("inf"):
            raise SpecError(f"distill.{name}: must be a finite number >= 0 or unset, got {value}")
    if d.min_len_ratio is not None and d.max_len_ratio is not None and d.min_len_ratio > d.max_len_ratio:
        raise SpecError(f"distill.min_len_ratio: {d.min_len_ratio} is above distill.max_len_ratio ({d.max_len_ratio})")


def _at_least(name: str, value: float | None, low: float) -> None:
    if value is not None and value < low:
        raise SpecError(f"{name}: must be >= {low}, got {value}")
