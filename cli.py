"""`aggdec` command line: parse, validate, call the library. No decoding logic lives here."""

from __future__ import annotations

import os
import signal
import sys


def _interrupted_while_loading(kind, value, tb, hook=sys.excepthook) -> None:
    """SIGINT before `run` handles it (while the CLI loads): the one line and exit status of a stopped
    command instead of a traceback; nothing has started that needs stopping."""
    if issubclass(kind, KeyboardInterrupt):
        sys.stderr.write("aggdec: stopped (SIGINT)\n")
        sys.stderr.flush()
        os._exit(128 + signal.SIGINT)
    hook(kind, value, tb)


sys.excepthook = _interrupted_while_loading

import json  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import click  # noqa: E402

from aggdec.model.config import HF_FAMILIES as _FAMILIES  # noqa: E402  (torch-free)

DEFAULT_MODEL = str(Path(__file__).resolve().parent / "models" / "gec-base")
HF_FAMILIES = ", ".join(_FAMILIES).replace("m2m_100", "m2m_100/NLLB")


class Failure(click.ClickException):
    """A failure the user can act on: printed as one line, `aggdec: error: ...`, exit status 2."""

    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"aggdec: error: {self.format_message()}", err=True)


class Stopped(click.ClickException):
    """The command was stopped by a signal: one line, `aggdec: stopped (SIGINT)[; detail]`, exit
    status 128 + the signal's number (130 for SIGINT, 143 for SIGTERM), as shells report it."""

    def __init__(self, detail: str = ""):
        super().__init__(detail)
        self.signum = _stop_signal[0]
        self.exit_code = 128 + self.signum

    def show(self, file=None) -> None:
        detail = self.format_message()
        click.echo(f"aggdec: stopped ({signal.Signals(self.signum).name}){'; ' + detail if detail else ''}", err=True)

    def exit(self) -> None:
        """Show the line and exit at once: Ray is shut down by then, and what is left to finalize (Ray
        Data's iterators) could only print errors after the line."""
        self.show()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(self.exit_code)


_stop_signal = [signal.SIGINT]
"""The signal that stopped the command: SIGINT (Python's KeyboardInterrupt) unless _terminate saw SIGTERM."""


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog="""\b
Exit status:
  0    done
  1    an unexpected error (one line; --debug for the traceback)
  2    bad input, options or spec, or a job whose units did not all decode (the message names the
       file, row group, column or option; the other units are committed)
  130  stopped by SIGINT (Ctrl-C)
  143  stopped by SIGTERM
A stopped job keeps what it committed: rerun the same command to resume.""")
@click.version_option(package_name="aggdec")
@click.option("--debug", is_flag=True, help="Show tracebacks of unexpected errors (default: one line).")
def main(debug: bool) -> None:
    """aggdec: lossless aggressive decoding for seq2seq models, in-process or as Ray corpus jobs."""


def run() -> None:
    """The `aggdec` entry point: `main`, with any unexpected error and every warning as one line
    unless --debug, what aggdec logs at INFO (logger "aggdec") on stderr, and SIGINT / SIGTERM as a
    Stopped line with exit status 130 / 143."""
    if "--debug" not in sys.argv[1:]:
        warnings.showwarning = _one_line_warning
    said = logging.StreamHandler()  # what aggdec logs for the user (compile = "auto"'s choice): as it is, on stderr
    said.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("aggdec")
    logger.addHandler(said)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    signal.signal(signal.SIGTERM, _terminate)
    try:
        main(standalone_mode=False)
    except (click.exceptions.Abort, KeyboardInterrupt):
        Stopped().exit()
    except Stopped as e:
        e.exit()
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except Exception as e:  # noqa: BLE001 - the last line of defence of a command line tool
        if "--debug" in sys.argv[1:]:
            raise
        click.echo(f"aggdec: error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                   "(rerun with --debug for the traceback)", err=True)
        sys.exit(1)


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    click.echo(f"aggdec: warning: {message}", err=True)


def _load_translator(model: str, trust_checkpoint: bool, data_dir: str | None, bpe: str | None, bpe_model: str | None,
                     device: str = "cpu"):
    import torch

    from aggdec.api import Translator

    if device == "cuda" and not torch.cuda.is_available():
        raise click.BadParameter(f"no CUDA device is visible to torch {torch.__version__}", param_hint="--device")
    path = Path(model)
    try:
        if path.suffix == ".pt":
            from aggdec.fairseq_io import load_fairseq

            if data_dir is None:
                raise click.UsageError("a fairseq checkpoint needs --data-dir (the directory with dict.src.txt/dict.tgt.txt)")
            translator = Translator(load_fairseq(path, Path(data_dir), trust=trust_checkpoint, bpe=bpe,
                                                 bpe_model=Path(bpe_model) if bpe_model else None))
            translator.model.to(device)
            return translator
        return Translator.load(path, device=device, trust=trust_checkpoint)
    except (FileNotFoundError, ValueError, PermissionError) as e:
        raise Failure(str(e)) from e


def _decoding_params() -> list[click.Option]:
    """`aggdec decode`'s --method and one option per decoding option of every registered method
    (aggdec.decoding.method_options), generated from the options' fields: name, type, bounds, choices and
    help. Unset flags are None."""
    from aggdec.decoding.method_options import OPTIONS, all_options
    from aggdec.decoding.options import choice_text

    params = [click.Option(["--method"], default="greedy", show_default=True, type=click.Choice(list(OPTIONS)),
                           help="greedy/iad/gad/blockwise are lossless (= greedy); gad++ and beam are not.")]
    for name, (f, hint) in all_options().items():
        meta, base = f.metadata, _base_type(hint)
        if meta.get("choices"):  # the flag alone, where true is a choice, means true
            kind = {"type": click.Choice([choice_text(c) for c in meta["choices"]])}
            if True in meta["choices"]:
                kind.update(is_flag=False, flag_value="true")
        elif base is bool:
            kind = {"is_flag": True}
        elif meta.get("path"):
            kind = {"type": click.Path(exists=True, file_okay=False)}
        elif base in (int, float):
            rng = click.IntRange if base is int else click.FloatRange
            kind = {"type": rng(min=meta["low"]) if meta.get("low") is not None else base}
        else:
            kind = {"type": str}
        default = "" if f.default is None else f"  [default: {f.default}]"
        # the field's own name is a flag too (the job spec's key), beside a shorter one an option declares
        flags = dict.fromkeys([meta.get("flag") or "--" + name.replace("_", "-"), "--" + name.replace("_", "-")])
        params.append(click.Option([*flags, name], default=None, help=meta["help"] + default, **kind))
    return params


class _DecodeCommand(click.Command):
    """A command whose decoding flags (_decoding_params) are made when it is used, not when the CLI
    loads: listing the commands, or any other command's help, does not import the method registry
    and torch with it."""

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        if not any(p.name == "method" for p in self.params):
            self.params[1:1] = _decoding_params()  # after --model, as the help lists them
        return super().get_params(ctx)


def _base_type(hint):
    import typing

    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


@main.command(cls=_DecodeCommand)
@click.option("--model", "-m", default=DEFAULT_MODEL, show_default=True,
              help=f"Project model directory, a Hugging Face model directory ({HF_FAMILIES}), "
                   "or a fairseq checkpoint*.pt (then --data-dir and --trust-checkpoint).")
@click.option("--data-dir", type=click.Path(exists=True, file_okay=False), default=None, help="fairseq data dir with dictionaries.")
@click.option("--bpe", type=click.Choice(["subword_nmt", "sentencepiece"]), default=None, help="fairseq models: segmentation.")
@click.option("--bpe-model", type=click.Path(exists=True, dir_okay=False), default=None, help="BPE codes or sentencepiece model.")
@click.option("--trust-checkpoint", is_flag=True,
              help="Allow loading a pickled fairseq .pt or pytorch_model.bin file (it can run code).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where the model runs (fp32 either way).")
@click.option("--stats", "stats_path", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write per-sentence statistics as JSON lines here.")
@click.option("--input", "-i", "input_path", type=click.File("r", encoding="utf-8", errors="surrogateescape"), default="-",
              help="Input text, one sentence per line (default: stdin).")
def decode(model, method, data_dir, bpe, bpe_model, trust_checkpoint, device, stats_path, input_path, **flags) -> None:
    """Decode text in-process (no Ray): one sentence per line in, one output line out.

    Decoding options are those of aggdec.decoding.method_options; options of other methods than --method
    are ignored (with a note).

    \b
    Examples:
      aggdec decode --method iad < noisy.txt > corrected.txt
      aggdec decode -m models/ende-base --method beam --beam 5 < en.txt > de.txt
      aggdec decode -m models/ende-base --method gad --drafter models/ende-base-draft-head --block-size 4 < en.txt
      aggdec decode -m models/ende-base --method gad++ --drafter models/ende-base-draft-head --top-beta 3 --tau 1
      aggdec decode -m ckpt/checkpoint_best.pt --data-dir data-bin --trust-checkpoint --method greedy < in.txt
    """
    from aggdec.api import summarize
    from aggdec.decoding.method_options import options_from_mapping
    from aggdec.decoding.options import OptionError
    from aggdec.schema import decoded_columns

    given = {k: v for k, v in flags.items() if v is not None and v is not False}
    try:
        opts, unused = options_from_mapping({"method": method, **given}, method)
    except OptionError as e:
        raise click.BadParameter(e.message, param_hint="--" + e.name.replace("_", "-")) from e
    if unused:
        click.echo(f"note: not options of method {method}, ignored: {', '.join(unused)}", err=True)
    translator = _load_translator(model, trust_checkpoint, data_dir, bpe, bpe_model, device)
    lines = [line.rstrip("\n") for line in input_path]
    t0 = time.perf_counter()
    try:
        results = translator.translate_batch(lines, opts)
    except (FileNotFoundError, ValueError) as e:  # a drafter that does not load or fit the model
        raise Failure(str(e)) from e
    seconds = time.perf_counter() - t0
    for r in results:
        click.echo(r.text)
    if stats_path:
        columns = decoded_columns(results)
        columns.pop("hyp")
        with open(stats_path, "w", encoding="utf-8") as f:
            for i in range(len(results)):
                f.write(json.dumps({"line": i + 1, **{k: v[i] for k, v in columns.items()}}) + "\n")
    summary = summarize(results, seconds)
    bad = {k: v for k, v in summary["status"].items() if k != "ok"}
    rows = summary["rows"]
    if method == "beam":  # no verifier: a call is a search step, every beam's token at once, until all end
        calls = f"{summary['iterations'] / max(rows, 1):.1f} decoder calls a sentence (beams together)"
    else:
        calls = f"{summary['tokens_per_iter']:.2f} tokens per verifier call"
    click.echo(f"{rows} sentence{'' if rows == 1 else 's'} in {seconds:.2f}s ({summary['sentences_per_s']:.1f}/s), "
               f"{calls}"
               + (f", mean accepted draft tokens per verifier call {summary['mean_accepted_per_iter']:.2f}"
                  if summary["drafted"] else "")
               + (f", status {bad}" if bad else ""), err=True)


@main.command()
@click.argument("checkpoint", type=click.Path(exists=True))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--from", "origin", type=click.Choice(["fairseq", "transformers"]), default="fairseq", show_default=True,
              help=f"fairseq: CHECKPOINT is a fairseq .pt; transformers: a local Hugging Face model directory "
                   f"({HF_FAMILIES}) with its tokenizer files.")
@click.option("--to", "target", type=click.Choice(["aggdec", "fairseq"]), default="aggdec", show_default=True,
              help="aggdec: fairseq checkpoint -> project format; fairseq: project model dir -> fairseq checkpoint + dicts.")
@click.option("--data-dir", type=click.Path(exists=True, file_okay=False), default=None, help="fairseq data dir with dictionaries.")
@click.option("--bpe", type=click.Choice(["subword_nmt", "sentencepiece"]), default=None)
@click.option("--bpe-model", type=click.Path(exists=True, dir_okay=False), default=None)
@click.option("--trust-checkpoint", is_flag=True,
              help="Allow loading a pickled fairseq .pt or pytorch_model.bin file (it can run code).")
def convert(checkpoint, out_dir, origin, target, data_dir, bpe, bpe_model, trust_checkpoint) -> None:
    """Convert fairseq checkpoints and Hugging Face model directories to the project's safetensors
    format, and project models to fairseq.

    \b
    Examples:
      aggdec convert ckpt/checkpoint_best.pt models/my-gec --data-dir data-bin --trust-checkpoint
      aggdec convert ~/opus-mt-en-de models/opus-mt-en-de --from transformers
      aggdec convert models/gec-base export/gec-base-fairseq --to fairseq
    """
    from aggdec import fairseq_io

    try:
        if origin == "transformers":
            if target != "aggdec":
                raise click.UsageError("--from transformers converts to the project format only (--to aggdec)")
            from aggdec import hf_import

            out = hf_import.convert(Path(checkpoint), Path(out_dir), trust=trust_checkpoint)
        elif target == "fairseq":
            out = fairseq_io.save_fairseq(Path(checkpoint), Path(out_dir))
        else:
            if data_dir is None:
                raise click.UsageError("--data-dir is required to convert a fairseq checkpoint")
            out = fairseq_io.convert_fairseq(Path(checkpoint), Path(data_dir), Path(out_dir), trust=trust_checkpoint,
                                             bpe=bpe, bpe_model=Path(bpe_model) if bpe_model else None)
    except (FileNotFoundError, ValueError, PermissionError) as e:
        raise Failure(str(e)) from e
    click.echo(f"wrote {out}")


@main.group()
def cache() -> None:
    """The store of compiled decoder steps on this machine (AGGDEC_CACHE_DIR; bounded by AGGDEC_CACHE_MAX_MB,
    least recently used packages dropped first)."""


@cache.command("list")
def cache_list() -> None:
    """List the stored steps for this torch and CPU, most recently used first."""
    import datetime

    from aggdec import step_store

    found = step_store.entries()
    for e in found:
        used = datetime.datetime.fromtimestamp(e.used).strftime("%Y-%m-%d %H:%M")
        click.echo(f"{e.size / 2**20:8.1f} MB  {used}  {e.key[:12]}  {e.what}")
    total = sum(e.size for e in found)
    click.echo(f"{len(found)} package{'' if len(found) == 1 else 's'}, {total / 2**20:.1f} MB of "
               f"{step_store.max_bytes() / 2**20:.0f} MB, in {step_store.store_dir()}")
    if os.path.isdir(step_store.inductor_dir()):
        click.echo(f"TorchInductor's cache: {step_store.size(step_store.inductor_dir()) / 2**20:.1f} MB in "
                   f"{step_store.inductor_dir()} (aggdec cache clear empties it too)")


@cache.command("clear")
def cache_clear() -> None:
    """Remove every stored step (every torch version's and CPU's), what compiling measured, and TorchInductor's
    cache where aggdec keeps it."""
    from aggdec import step_store

    click.echo(f"removed {step_store.clear() / 2**20:.1f} MB from {step_store.base()}")


@main.group()
def train() -> None:
    """Train models (AR verifier)."""


_PASS_THROUGH = {"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []}


@train.command("ar", context_settings=_PASS_THROUGH)
@click.pass_context
def train_ar(ctx) -> None:
    """Train an AR encoder-decoder; options as `python -m aggdec.train.ar --help`."""
    from aggdec.train.args import ar_config

    config = ar_config(ctx.args)  # --help and bad flags answer here, before torch loads
    from aggdec.train import ar

    try:
        ar.train_ar(config)
    except ValueError as e:  # bad data or options for that data (a vocabulary it cannot hold)
        raise Failure(str(e)) from e


@train.command("heads", context_settings=_PASS_THROUGH)
@click.pass_context
def train_heads(ctx) -> None:
    """Train blockwise proposal heads on a frozen verifier; options as `python -m aggdec.train.heads --help`."""
    from aggdec.train.args import heads_args

    args = heads_args(ctx.args)
    from aggdec.train import heads

    heads.train_heads(args)


@train.command("seqkd", context_settings=_PASS_THROUGH)
@click.pass_context
def train_seqkd(ctx) -> None:
    """Make Seq-KD data (the verifier's own outputs) in-process; options as `python -m aggdec.train.seqkd --help`."""
    from aggdec.train.args import seqkd_args

    args = seqkd_args(ctx.args)
    from aggdec.train import seqkd

    sys.exit(seqkd.run(args))



# -- corpus jobs on Ray -------------------------------------------------------------------------

DEFAULT_SPEC = str(Path(__file__).resolve().parent / "examples" / "correct.toml")


def _overrides(sets: tuple[str, ...], **flags) -> list[str]:
    """Explicit flags become dotted overrides (applied after --set, so they win)."""
    names = {"input_path": "input.path", "output": "output.dir", "model": "model", "method": "decode.method",
             "drafter": "decode.drafter",
             "actors": "resources.actors", "gpus_per_actor": "resources.gpus_per_actor"}
    out = list(sets)
    for key, value in flags.items():
        if value is not None:
            out.append(f"{names[key]}={json.dumps(value)}")  # a JSON string or number is a TOML value
    return out


def _load_spec(spec_path: str | None, overrides: list[str], check_model: bool = True):
    from jobs.spec import SpecError, load_spec

    try:
        return load_spec(spec_path, overrides, check_model=check_model)
    except SpecError as e:
        raise Failure(str(e)) from e


_spec_overrides = [
    click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
                 help="Override a spec field, e.g. --set decode.method=iad --set decode.max_tokens=4096."),
    click.option("--input", "input_path", default=None, help="Same as --set input.path=PATH."),
    click.option("--output", "-o", "output", default=None, help="Same as --set output.dir=DIR."),
    click.option("--model", "-m", "model", default=None, help="Same as --set model=DIR."),
    click.option("--method", default=None, metavar="METHOD",
                 help="Same as --set decode.method=METHOD (the methods of `aggdec decode --method`)."),
    click.option("--drafter", default=None, help="Same as --set decode.drafter=DIR (gad, gad++, blockwise)."),
    click.option("--actors", type=click.IntRange(min=0), default=None, help="Same as --set resources.actors=N."),
    click.option("--gpus-per-actor", type=click.FloatRange(min=0), default=None,
                 help="Same as --set resources.gpus_per_actor=G (1: one actor per GPU)."),
]


_take_over_lease = click.option(
    "--take-over-lease", is_flag=True,
    help="Take over the output directory's lease from another job now, without waiting for its heartbeat to "
         "go stale: only for a job known to be gone (a driver killed on another host).")


def _with_spec_overrides(fn):
    for option in reversed(_spec_overrides):
        fn = option(fn)
    return fn


@main.command("run")
@click.argument("spec", required=False, type=click.Path(dir_okay=False))
@click.option("--address", default=None,
              help="Ray cluster to join (HOST:6379 or 'auto'); default: an embedded local Ray, or RAY_ADDRESS if set.")
@click.option("--num-cpus", type=click.IntRange(min=1), default=None, help="CPUs of the embedded local Ray (default: all).")
@click.option("--verbose", "-v", is_flag=True, help="Also show what the job does unit by unit, and Ray's own messages.")
@_take_over_lease
@_with_spec_overrides
def run_cmd(spec, address, num_cpus, verbose, take_over_lease, sets, input_path, output, model, method, drafter,
            actors, gpus_per_actor) -> None:
    """Run a corpus job (a TOML spec) on Ray: Parquet in, one Parquet file per commit unit out.

    Without SPEC, runs the embedded default examples/correct.toml (IAD correction of the sample
    corpus with models/gec-base into out/gec-sample). Inputs are checked before Ray starts; shards
    already committed in the output directory are skipped, so rerunning resumes a killed job.
    Paths in the spec file are relative to the file; paths on the command line to the current directory.
    One job at a time per output directory: a second job is refused, naming the first (its lease,
    OUT/_lease.json, is taken over once its heartbeat is 60 s old or its process on this host is gone).

    \b
    Examples:
      aggdec run
      aggdec run examples/correct.toml --set decode.method=greedy --output out/greedy
      aggdec run job.toml --input 'data/*.parquet' --actors 2 --set decode.max_tokens=4096
      aggdec run job.toml --address auto          # on GPU nodes: one actor per GPU
      aggdec run job.toml --address auto --gpus-per-actor 0   # CPU actors even there
    """
    from jobs.storage import removed_if_left_empty

    overrides = _overrides(sets, input_path=input_path, output=output, model=model, method=method, drafter=drafter,
                           actors=actors, gpus_per_actor=gpus_per_actor)
    job = _load_spec(spec or DEFAULT_SPEC, overrides)
    with removed_if_left_empty(job.output.dir):  # a job that fails to start leaves no directory behind
        result = _run_checked(job, address, num_cpus, verbose, take_over_lease, own_spec=spec is not None,
                              overrides=overrides)
    click.echo(result.summary_line())


def _run_checked(job, address: str | None, num_cpus: int | None, verbose: bool, take_over_lease: bool, *,
                 own_spec: bool, overrides: list[str]):
    """`aggdec run`'s work once the spec is read: take the output's lease, check the job, connect to
    Ray, run it."""
    from cluster.connection import check_reachable
    from jobs.inputs import check_output_apart, inspect_inputs
    from jobs.lease import Lease
    from jobs.spec import SpecError
    from jobs.storage import Location

    try:  # first: where no cluster answers, that is the one line (connect checks again)
        if address or os.environ.get("RAY_ADDRESS"):
            check_reachable(address or os.environ["RAY_ADDRESS"])
    except ConnectionError as e:
        raise Failure(f"{'--address' if address else 'RAY_ADDRESS'} {e}") from None
    # the output location's lease before torch and Ray load (once the output is known to be apart from the
    # inputs): a job started at the same moment is refused at once
    try:
        shards = inspect_inputs(job)
        check_output_apart(job, shards)
        lease = Lease(Location(job.output.dir), take_over=take_over_lease)
        lease.acquire()
    except SpecError as e:
        raise Failure(str(e)) from e
    except OSError as e:
        raise Failure(f"output.dir: {job.output.dir}: cannot be written ({e.strerror or e})") from e
    try:
        return _run_leased(job, lease, shards, address, num_cpus, verbose, own_spec=own_spec, overrides=overrides)
    finally:
        lease.release()


def _run_leased(job, lease, shards, address: str | None, num_cpus: int | None, verbose: bool, *, own_spec: bool,
                overrides: list[str]):
    """`aggdec run`'s work once the output's lease is held: check the job, connect to Ray, run it."""
    import torch

    from aggdec.model.precision import cpu_isa, cpu_warning
    from cluster.connection import connect, disconnect
    from jobs.preflight import check_job
    from jobs.lease import takeover_note
    from jobs.run import run_job
    from jobs.spec import SpecError

    say = _echo_err
    if lease.taken_over is not None:
        say(takeover_note(lease.taken_over, lease.take_over))
    try:
        shards = check_job(job, warn=say, lease=lease, shards=shards)  # output, model, ids: before Ray starts
    except SpecError as e:
        raise Failure(str(e)) from e
    say(f"{len(shards)} input file(s), {sum(s.rows for s in shards)} rows; method {job.method}; "
        f"output {job.output.dir}")
    gpus = job.resources.gpus_per_actor
    if not (gpus or address or os.environ.get("RAY_ADDRESS")) and (gpus == 0 or not torch.cuda.is_available()):
        slow = cpu_warning(job.decode.precision, cpu_isa())  # the actors run on this machine's CPU
        if slow:
            say(f"aggdec: warning: {slow}")
    ignored = _ignored_options(job, own_spec, overrides)
    if ignored:
        say(f"note: not options of method {job.method}, ignored: {', '.join(ignored)}")
    progress = _ProgressLine()
    try:
        conn = connect(address, num_cpus=num_cpus, quiet=not verbose)  # keeps run()'s SIGTERM handler
    except ConnectionError as e:
        raise Failure(f"{'--address' if address else 'RAY_ADDRESS'} {e}") from None
    try:
        return run_job(job, log=say if verbose else lambda msg: None, warn=progress.say, progress=progress,
                       timings={"ray_init_s": round(conn.seconds, 3)}, lease=lease)
    except SpecError as e:
        raise Failure(str(e)) from e
    except KeyboardInterrupt:
        raise Stopped(f"committed units are kept in {job.output.dir}, rerun to resume") from None
    finally:
        progress.end()
        stop = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the job is over: shutting Ray down is not interrupted
        disconnect(conn)
        signal.signal(signal.SIGTERM, stop)


def _ignored_options(job, own_spec: bool, overrides: list[str]) -> list[str]:
    """The options of other methods than the job's that the user set: every one in their own spec
    (`own_spec`) and on the command line; not those of the embedded default spec's [decode] table
    (IAD's options), which `--set decode.method=greedy` leaves behind without the user having set them."""
    from jobs.spec import parse_override

    given = {key.removeprefix("decode.") for key, _ in map(parse_override, overrides) if key.startswith("decode.")}
    return [name for name in job.unused_options if own_spec or name in given]


def _echo_err(msg: str) -> None:
    click.echo(msg, err=True)


def _terminate(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second SIGTERM does not interrupt the unwinding
    _stop_signal[0] = signal.SIGTERM
    raise KeyboardInterrupt  # unwinds like Ctrl-C: Ray is shut down, the message is one line


class _ProgressLine:
    """One progress line on stderr: rewritten in place on a terminal, every 10 s otherwise."""

    def __init__(self, every_s: float = 10.0):
        self.tty = sys.stderr.isatty()
        self.every_s, self.last, self.shown = every_s, 0.0, False

    def __call__(self, p) -> None:
        now = time.monotonic()
        if self.tty:
            click.echo("\r" + p.line().ljust(100), nl=False, err=True)
            self.shown = True
        elif now - self.last >= self.every_s:
            click.echo(p.line(), err=True)
            self.last = now

    def say(self, msg: str) -> None:
        """A line of its own, below the progress line."""
        self.end()
        click.echo(msg, err=True)

    def end(self) -> None:
        if self.shown:
            click.echo(err=True)
            self.shown = False


@main.command("submit")
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--address", required=True, envvar="RAY_API_SERVER_ADDRESS",
              help="Ray dashboard / Jobs API address, e.g. http://HEAD:8265.")
@click.option("--pip", "pip", multiple=True, help="Extra pip requirement for the job's runtime_env (repeatable).")
@click.option("--submission-id", default=None, help="Job id to use (default: generated by Ray).")
@_take_over_lease
@_with_spec_overrides
def submit_cmd(spec, address, pip, submission_id, take_over_lease, sets, input_path, output, model, method, drafter,
               actors, gpus_per_actor) -> None:
    """Submit `aggdec run SPEC` to a running Ray cluster through the Ray Jobs API.

    The repository is uploaded as the job's working_dir, so SPEC and the paths in it are resolved
    on the cluster relative to the repository root. --output is required: a location every node can
    write (s3://, gs://, ... or a shared mount); decode actors write their units there themselves.
    The spec's fields are checked here first. Needs the `cluster` extra (ray[default]).

    \b
    Examples:
      aggdec submit examples/correct.toml --address http://HEAD:8265 --output s3://bucket/out/job1
      aggdec submit job.toml --address http://HEAD:8265 --gpus-per-actor 1 --actors 0 --output /mnt/out/job1
      aggdec logs raysubmit_XXXX --address http://HEAD:8265 --follow
    """
    from cluster import jobs_api

    if not output:
        raise click.UsageError("--output is required: a location every node of the cluster can write, e.g. "
                               "s3://bucket/prefix or a shared mount such as /mnt/shared/out")
    overrides = _overrides(sets, input_path=input_path, output=output, model=model, method=method, drafter=drafter,
                           actors=actors, gpus_per_actor=gpus_per_actor)
    _load_spec(spec, overrides, check_model=False)
    path = Path(spec).resolve()
    try:
        spec_arg = str(path.relative_to(jobs_api.REPO_ROOT))
    except ValueError:
        spec_arg = spec
    run_args = [a for o in overrides for a in ("--set", o)] + (["--take-over-lease"] if take_over_lease else [])
    job_id, python = _jobs_call(lambda address, _: jobs_api.submit(address, spec_arg, run_args, pip=list(pip) or None,
                                                                    submission_id=submission_id), address, None)
    click.echo(job_id)
    if python != sys.executable:
        click.echo(f"note: the cluster runs the job with its own `{python}` (the first on its processes' PATH), which "
                   "needs aggdec's dependencies (or --pip)", err=True)
    click.echo(f"output: {output}", err=True)
    click.echo(f"follow with: aggdec logs {job_id} --address {address} --follow", err=True)


def _jobs_call(fn, address: str, job_id: str | None):
    """A Jobs API call whose failures (unknown job, an address where no cluster answers) become one-line errors."""
    try:
        return fn(address, job_id)
    except ConnectionError as e:  # jobs_api's probe of the address, or the Jobs SDK's
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise Failure(f"--address {text}" if text.startswith(address) else f"{address}: {text}") from None
    except Exception as e:  # noqa: BLE001 - the Jobs SDK raises RuntimeError, ValueError, ...
        text = str(e)
        if job_id and "does not exist" in text:
            raise Failure(f"{job_id}: no such job at {address}") from e
        if "Version check returned 404" in text:
            raise Failure(f"{address}: something answers there, but not a Ray dashboard (no /api/version)") from e
        raise Failure(f"{address}: {text.splitlines()[0] if text else type(e).__name__}") from e


_address_option = click.option("--address", required=True, envvar="RAY_API_SERVER_ADDRESS",
                               help="Ray dashboard / Jobs API address, e.g. http://HEAD:8265.")


@main.command("status")
@click.argument("job_id")
@_address_option
def status_cmd(job_id, address) -> None:
    """Show a submitted job's status (PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED).

    \b
    Example:
      aggdec status raysubmit_XXXX --address http://HEAD:8265
    """
    from cluster import jobs_api

    click.echo(json.dumps(_jobs_call(jobs_api.info, address, job_id), indent=2, default=str))


@main.command("logs")
@click.argument("job_id")
@_address_option
@click.option("--follow", "-f", is_flag=True, help="Stream the logs until the job ends.")
def logs_cmd(job_id, address, follow) -> None:
    """Print a submitted job's driver logs.

    \b
    Example:
      aggdec logs raysubmit_XXXX --address http://HEAD:8265 --follow
    """
    from cluster import jobs_api

    if not follow:
        click.echo(_jobs_call(jobs_api.logs, address, job_id), nl=False)
        return
    import asyncio

    async def _follow(address: str, job_id: str) -> None:
        async for lines in jobs_api.tail_logs(address, job_id):
            click.echo(lines, nl=False)

    _jobs_call(lambda address, job_id: asyncio.run(_follow(address, job_id)), address, job_id)


@main.command("stop")
@click.argument("job_id")
@_address_option
def stop_cmd(job_id, address) -> None:
    """Stop a submitted job. Committed shards stay; `aggdec run` with the same spec resumes.

    \b
    Example:
      aggdec stop raysubmit_XXXX --address http://HEAD:8265
    """
    from cluster import jobs_api

    stopped = _jobs_call(jobs_api.stop, address, job_id)
    click.echo(f"{job_id}: {'stop requested' if stopped else 'not running'}")


# -- evaluation, reports, exports ---------------------------------------------------------------

TASK_OF_KIND = {"correct": "gec", "translate": "translation"}


def _eval_inputs(out_dir, hyp_file, ref_file, src_file, ref_column, task) -> tuple[dict, str]:
    """(hyps/refs/srcs plus provenance, task) from an output directory or from text files."""
    from aggdec.evaluate import read_lines
    from aggdec.schema import count_status, read_manifest, read_outputs

    if out_dir and (hyp_file or ref_file or src_file):
        raise click.UsageError("give OUT_DIR or --hyp/--ref/--src files, not both")
    if out_dir:
        manifest = read_manifest(out_dir) if Path(out_dir).is_dir() else None
        kind = ((manifest or {}).get("spec") or {}).get("kind")
        task = task or TASK_OF_KIND.get(kind)
        if task is None:
            raise click.UsageError(f"{out_dir}: the job manifest does not say the task; give --task")
        table = read_outputs(out_dir, ["src", "hyp", ref_column, "status"])
        status = count_status(table.column("status").to_pylist())
        text = {name: ["" if v is None else str(v) for v in table.column(col).to_pylist()]
                for name, col in (("src", "src"), ("hyp", "hyp"), ("ref", ref_column))}
        return {**text, "input": {"out_dir": out_dir, "ref_column": ref_column, "status": status,
                                  "job_signature": (manifest or {}).get("signature")}}, task
    if not (hyp_file and ref_file):
        raise click.UsageError("give OUT_DIR, or --hyp and --ref (and --src for --task gec)")
    if task is None:
        raise click.UsageError("--task is required with --hyp/--ref files")
    if task == "gec" and not src_file:
        raise click.UsageError("--task gec needs the uncorrected sources: --src FILE")
    text = {"hyp": read_lines(hyp_file), "ref": read_lines(ref_file), "src": read_lines(src_file) if src_file else None}
    return {**text, "input": {"hyp": hyp_file, "ref": ref_file, "src": src_file}}, task


@main.command("eval")
@click.argument("out_dir", required=False, type=click.Path(exists=True))
@click.option("--task", type=click.Choice(["translation", "gec"]), default=None,
              help="translation: sacrebleu BLEU + chrF; gec: ERRANT P/R/F0.5 + exact match. "
                   "Default for OUT_DIR: from the job's kind (translate/correct).")
@click.option("--ref-column", default="ref", show_default=True, help="OUT_DIR: the reference column.")
@click.option("--hyp", "hyp_file", type=click.Path(exists=True, dir_okay=False), help="Hypotheses, one per line.")
@click.option("--ref", "ref_file", type=click.Path(exists=True, dir_okay=False), help="References, one per line.")
@click.option("--src", "src_file", type=click.Path(exists=True, dir_okay=False),
              help="Sources, one per line (--task gec: the uncorrected text).")
@click.option("--tokenise", is_flag=True,
              help="gec: tokenise with spaCy (for detokenised text); default: the text is already tokenised.")
@click.option("--compare", "compare_dir", type=click.Path(exists=True),
              help="Another output directory: check by id that both have identical hyps (losslessness).")
@click.option("--examples", type=click.IntRange(min=0), default=5, show_default=True,
              help="--compare: differing rows to show.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Also write the full result as JSON here.")
def eval_cmd(out_dir, task, ref_column, hyp_file, ref_file, src_file, tokenise, compare_dir, examples,
             json_path) -> None:
    """Score a job's output directory (or text files) against references, or compare two runs.

    With --compare, exits with status 1 when any id's hyp differs or an id is missing on one side.

    \b
    Examples:
      aggdec eval out/ende --ref-column ref --task translation
      aggdec eval out/gec-sample --task gec --tokenise --json scores.json
      aggdec eval --hyp hyp.txt --ref ref.txt --src src.txt --task gec
      aggdec eval out/iad --compare out/greedy
    """
    from aggdec.evaluate import bleu_chrf, compare_outputs, gec_scores
    from aggdec.schema import read_by_id

    try:
        if compare_dir:
            if not out_dir:
                raise click.UsageError("--compare needs OUT_DIR (the first run's output directory)")
            result = {"a": out_dir, "b": compare_dir,
                      **compare_outputs(read_by_id(out_dir), read_by_id(compare_dir), examples=examples)}
        else:
            data, task = _eval_inputs(out_dir, hyp_file, ref_file, src_file, ref_column, task)
            scores = (bleu_chrf(data["hyp"], data["ref"]) if task == "translation"
                      else gec_scores(data["src"], data["hyp"], data["ref"], tokenise=tokenise))
            result = {"task": task, **data["input"], "scores": scores}
    except (FileNotFoundError, ValueError, ImportError) as e:
        raise Failure(str(e)) from e
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    if compare_dir:
        _echo_comparison(result)
        if result["different"] or result["missing_in_a"] or result["missing_in_b"]:
            sys.exit(1)
        return
    s = result["scores"]
    if "status" in result and set(result["status"]) - {"ok"}:
        click.echo(f"rows by status: {result['status']} (all rows are scored)")
    if task == "translation":
        p = "/".join(f"{x:.1f}" for x in s["bleu_precisions"])
        click.echo(f"BLEU  {s['bleu']:6.2f}  {p} (BP {s['bleu_bp']:.3f}, hyp_len {s['sys_len']}, "
                   f"ref_len {s['ref_len']})  {s['bleu_signature']}")
        click.echo(f"chrF  {s['chrf']:6.2f}  {s['chrf_signature']}")
    else:
        click.echo(f"ERRANT span correction: TP {s['tp']} FP {s['fp']} FN {s['fn']}  P {s['precision']:.4f} "
                   f"R {s['recall']:.4f} F0.5 {s['f0.5']:.4f}  ({s['scored']} of {s['sentences']} sentences scored)")
        click.echo(f"exact match {s['exact_match']:.2%}  {s['signature']}")


def _echo_comparison(r: dict) -> None:
    click.echo(f"{r['identical']}/{r['common']} shared ids identical ({r['identical_share']:.2%}); "
               f"{r['a']}: {r['a_rows']} rows, {r['b']}: {r['b_rows']} rows")
    for side, ids in (("missing in " + r["a"], r["missing_in_a"]), ("missing in " + r["b"], r["missing_in_b"])):
        if ids:
            click.echo(f"{len(ids)} ids {side}: {', '.join(ids[:10])}{' ...' if len(ids) > 10 else ''}")
    for ex in r["examples"]:
        click.echo(f"--- {ex['id']}\n  a: {ex['a']}\n  b: {ex['b']}")


@main.command("report")
@click.argument("out_dir", type=click.Path(exists=True))
@click.option("--bench", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Benchmark results JSON (bench/*.py --out), repeatable: adds a method comparison.")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, writable=True), default="report.html",
              show_default=True, help="The HTML file to write (self-contained: plots are embedded).")
@click.option("--compare", "greedy_dir", type=click.Path(exists=True), default=None,
              help="The output of a greedy run of the same inputs: adds decoder time against greedy, by id.")
def report_cmd(out_dir, bench, out_path, greedy_dir) -> None:
    """Write one self-contained HTML page about a job's output: what drafting did and why, verifier
    calls and calls saved vs edit ratio, accepted tokens per call, throughput by length, acceptance by
    position, time against a greedy run (--compare), benchmarks.

    \b
    Examples:
      aggdec report out/gec-sample --out report.html
      aggdec report out/gec-sample --compare out/greedy --out report.html
      aggdec report out/gec-sample --bench bench/results/iad.json --out report.html
    """
    from aggdec.report import build_report

    try:
        page = build_report(out_dir, list(bench), compare=greedy_dir)
    except (FileNotFoundError, ValueError, ImportError) as e:
        raise Failure(str(e)) from e
    Path(out_path).write_text(page, encoding="utf-8")
    click.echo(f"wrote {out_path}")


@main.command("export")
@click.argument("out_dir", type=click.Path(exists=True))
@click.option("--format", "fmt", type=click.Choice(["fairseq"]), default="fairseq", show_default=True,
              help="fairseq: fairseq-generate-style S-/T-/H-/D- lines plus I-<id> iteration counts.")
@click.option("--out", "out_file", type=click.File("w", encoding="utf-8"), default="-",
              help="File to write (default: stdout).")
@click.option("--ref-column", default=None, help="Also write T-<id> lines from this reference column.")
def export_cmd(out_dir, fmt, out_file, ref_column) -> None:
    """Export a job's output directory as text, rows in natural id order.

    A backslash or a control character (tab, line break, NUL, ...) in an id is written as its
    Python escape (\\\\, \\t, \\n, \\x00, \\u2028), so that every record stays on one line.

    \b
    Examples:
      aggdec export out/ende --format fairseq --out generate-test.txt
      aggdec export out/ende --ref-column ref | grep ^D- | cut -f3 > hyp.txt
    """
    from aggdec.export import fairseq_lines

    try:
        for line in fairseq_lines(out_dir, ref_column=ref_column):
            out_file.write(line + "\n")
    except (FileNotFoundError, ValueError) as e:
        raise Failure(str(e)) from e


if __name__ == "__main__":
    run()
