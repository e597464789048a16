"""`aggdec` command line: parse, validate, call the library. No decoding logic lives here."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

DEFAULT_MODEL = str(Path(__file__).resolve().parent / "models" / "gec-base")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="aggdec")
def main() -> None:
    """aggdec: lossless aggressive decoding for seq2seq models, in-process or as Ray corpus jobs."""


def _load_translator(model: str, trust_checkpoint: bool, data_dir: str | None, bpe: str | None, bpe_model: str | None):
    from aggdec.api import Translator

    path = Path(model)
    try:
        if path.suffix == ".pt":
            from aggdec.fairseq_io import load_fairseq

            if data_dir is None:
                raise click.UsageError("a fairseq checkpoint needs --data-dir (the directory with dict.src.txt/dict.tgt.txt)")
            return Translator(load_fairseq(path, Path(data_dir), trust=trust_checkpoint, bpe=bpe,
                                           bpe_model=Path(bpe_model) if bpe_model else None))
        return Translator.load(path)
    except (FileNotFoundError, ValueError, PermissionError) as e:
        raise click.ClickException(str(e)) from e


@main.command()
@click.option("--model", "-m", default=DEFAULT_MODEL, show_default=True,
              help="Project model directory, or a fairseq checkpoint*.pt (then --data-dir and --trust-checkpoint).")
@click.option("--method", type=click.Choice(["greedy", "beam", "iad"]), default="greedy", show_default=True)
@click.option("--beam", type=click.IntRange(min=1), default=5, show_default=True, help="Beam size for --method beam.")
@click.option("--lenpen", type=float, default=1.0, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=32, show_default=True, help="Most sentences decoded at once.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None, help="Most source tokens decoded at once.")
@click.option("--max-len-a", type=float, default=1.5, show_default=True, help="Output limit a*src_len + b.")
@click.option("--max-len-b", type=int, default=10, show_default=True)
@click.option("--draft-cap", type=click.IntRange(min=1), default=None, help="IAD: most draft tokens per row and call.")
@click.option("--adaptive-draft", is_flag=True, help="IAD: per-row draft cap that adapts to acceptance (needs --draft-cap).")
@click.option("--data-dir", type=click.Path(exists=True, file_okay=False), default=None, help="fairseq data dir with dictionaries.")
@click.option("--bpe", type=click.Choice(["subword_nmt", "sentencepiece"]), default=None, help="fairseq models: segmentation.")
@click.option("--bpe-model", type=click.Path(exists=True, dir_okay=False), default=None, help="BPE codes or sentencepiece model.")
@click.option("--trust-checkpoint", is_flag=True, help="Allow loading a pickled fairseq .pt file (it can run code).")
@click.option("--stats", "stats_path", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write per-sentence statistics as JSON lines here.")
@click.option("--input", "-i", "input_path", type=click.File("r", encoding="utf-8", errors="surrogateescape"), default="-",
              help="Input text, one sentence per line (default: stdin).")
def decode(model, method, beam, lenpen, batch_size, max_tokens, max_len_a, max_len_b, draft_cap, adaptive_draft,
           data_dir, bpe, bpe_model, trust_checkpoint, stats_path, input_path) -> None:
    """Decode text in-process (no Ray): one sentence per line in, one output line out.

    \b
    Examples:
      aggdec decode --method iad < noisy.txt > corrected.txt
      aggdec decode -m models/ende-base --method beam --beam 5 < en.txt > de.txt
      aggdec decode -m ckpt/checkpoint_best.pt --data-dir data-bin --trust-checkpoint --method greedy < in.txt
    """
    from aggdec.api import DecodeOptions, summarize

    try:
        opts = DecodeOptions(method=method, beam=beam, lenpen=lenpen, max_batch_size=batch_size, max_tokens=max_tokens,
                             max_len_a=max_len_a, max_len_b=max_len_b, draft_cap=draft_cap, adaptive_draft=adaptive_draft)
    except ValueError as e:
        raise click.BadParameter(str(e)) from e
    if adaptive_draft and draft_cap is None:
        raise click.BadParameter("--adaptive-draft needs --draft-cap", param_hint="--adaptive-draft")
    translator = _load_translator(model, trust_checkpoint, data_dir, bpe, bpe_model)
    lines = [line.rstrip("\n") for line in input_path]
    t0 = time.perf_counter()
    results = translator.translate_batch(lines, opts)
    seconds = time.perf_counter() - t0
    for r in results:
        click.echo(r.text)
    if stats_path:
        with open(stats_path, "w", encoding="utf-8") as f:
            for i, r in enumerate(results):
                row = {"line": i + 1, "status": r.status, "error": r.error, "src_len": r.src_len, "hyp_len": len(r.tokens),
                       "iterations": r.stats.iterations, "drafted": r.stats.drafted, "accepted": r.stats.accepted,
                       "accepted_per_iter": r.stats.accepted_per_iter, "decode_ms": round(r.stats.decode_ms, 3)}
                f.write(json.dumps(row) + "\n")
    summary = summarize(results, seconds)
    bad = {k: v for k, v in summary["status"].items() if k != "ok"}
    click.echo(f"{summary['rows']} sentences in {seconds:.2f}s ({summary['sentences_per_s']:.1f}/s), "
               f"{summary['tokens_per_iter']:.2f} tokens per verifier call"
               + (f", status {bad}" if bad else ""), err=True)


@main.command()
@click.argument("checkpoint", type=click.Path(exists=True))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--to", "target", type=click.Choice(["aggdec", "fairseq"]), default="aggdec", show_default=True,
              help="aggdec: fairseq checkpoint -> project format; fairseq: project model dir -> fairseq checkpoint + dicts.")
@click.option("--data-dir", type=click.Path(exists=True, file_okay=False), default=None, help="fairseq data dir with dictionaries.")
@click.option("--bpe", type=click.Choice(["subword_nmt", "sentencepiece"]), default=None)
@click.option("--bpe-model", type=click.Path(exists=True, dir_okay=False), default=None)
@click.option("--trust-checkpoint", is_flag=True, help="Allow loading a pickled fairseq .pt file (it can run code).")
def convert(checkpoint, out_dir, target, data_dir, bpe, bpe_model, trust_checkpoint) -> None:
    """Convert between fairseq checkpoints and the project's safetensors format.

    \b
    Examples:
      aggdec convert ckpt/checkpoint_best.pt models/my-gec --data-dir data-bin --trust-checkpoint
      aggdec convert models/gec-base export/gec-base-fairseq --to fairseq
    """
    from aggdec import fairseq_io

    try:
        if target == "fairseq":
            out = fairseq_io.save_fairseq(Path(checkpoint), Path(out_dir))
        else:
            if data_dir is None:
                raise click.UsageError("--data-dir is required to convert a fairseq checkpoint")
            out = fairseq_io.convert_fairseq(Path(checkpoint), Path(data_dir), Path(out_dir), trust=trust_checkpoint,
                                             bpe=bpe, bpe_model=Path(bpe_model) if bpe_model else None)
    except (FileNotFoundError, ValueError, PermissionError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"wrote {out}")


@main.group()
def train() -> None:
    """Train models (AR verifier)."""


@train.command("ar", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def train_ar(ctx) -> None:
    """Train an AR encoder-decoder; options as `python -m aggdec.train.ar --help`."""
    from aggdec.train import ar

    sys.exit(ar.main(ctx.args))


# -- corpus jobs on Ray -------------------------------------------------------------------------

DEFAULT_SPEC = str(Path(__file__).resolve().parent / "examples" / "correct.toml")


def _overrides(sets: tuple[str, ...], **flags) -> list[str]:
    """Explicit flags become dotted overrides (applied after --set, so they win)."""
    names = {"input_path": "input.path", "output": "output.dir", "model": "model", "method": "decode.method",
             "drafter": "drafter",
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
        raise click.ClickException(str(e)) from e


_spec_overrides = [
    click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
                 help="Override a spec field, e.g. --set decode.method=iad --set batching.max_tokens=4096."),
    click.option("--input", "input_path", default=None, help="Same as --set input.path=PATH."),
    click.option("--output", "-o", "output", default=None, help="Same as --set output.dir=DIR."),
    click.option("--model", "-m", "model", default=None, help="Same as --set model=DIR."),
    click.option("--method", default=None,
                 help="Same as --set decode.method=METHOD (greedy, beam, iad, gad, gad++, blockwise)."),
    click.option("--drafter", default=None, help="Same as --set drafter=DIR (gad, gad++, blockwise)."),
    click.option("--actors", type=click.IntRange(min=0), default=None, help="Same as --set resources.actors=N."),
    click.option("--gpus-per-actor", type=click.FloatRange(min=0), default=None,
                 help="Same as --set resources.gpus_per_actor=G (1: one actor per GPU)."),
]


def _with_spec_overrides(fn):
    for option in reversed(_spec_overrides):
        fn = option(fn)
    return fn


@main.command("run")
@click.argument("spec", required=False, type=click.Path(dir_okay=False))
@click.option("--address", default=None,
              help="Ray cluster to join (HOST:6379 or 'auto'); default: an embedded local Ray, or RAY_ADDRESS if set.")
@click.option("--num-cpus", type=click.IntRange(min=1), default=None, help="CPUs of the embedded local Ray (default: all).")
@_with_spec_overrides
def run_cmd(spec, address, num_cpus, sets, input_path, output, model, method, drafter, actors, gpus_per_actor) -> None:
    """Run a corpus job (a TOML spec) on Ray: Parquet in, one Parquet file per input file out.

    Without SPEC, runs the embedded default examples/correct.toml (IAD correction of the sample
    corpus with models/gec-base into out/gec-sample). Inputs are checked before Ray starts; shards
    already committed in the output directory are skipped, so rerunning resumes a killed job.
    Paths in the spec file are relative to the file; paths on the command line to the current directory.

    \b
    Examples:
      aggdec run
      aggdec run examples/correct.toml --set decode.method=greedy --output out/greedy
      aggdec run job.toml --input 'data/*.parquet' --actors 2 --set batching.max_tokens=4096
      aggdec run job.toml --address auto --gpus-per-actor 1 --actors 0   # one actor per GPU
    """
    from cluster.connection import connect, disconnect
    from jobs.inputs import inspect_inputs
    from jobs.run import run_job
    from jobs.spec import SpecError

    job = _load_spec(spec or DEFAULT_SPEC, _overrides(sets, input_path=input_path, output=output, model=model,
                                                      method=method, drafter=drafter, actors=actors,
                                                      gpus_per_actor=gpus_per_actor))
    try:
        shards = inspect_inputs(job)  # fail on bad inputs before starting Ray
    except SpecError as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"{len(shards)} input shard(s), {sum(s.rows for s in shards)} rows; method {job.method}; "
               f"output {job.output.dir}", err=True)
    conn = connect(address, num_cpus=num_cpus)
    try:
        result = run_job(job, log=lambda msg: click.echo(msg, err=True), timings={"ray_init_s": round(conn.seconds, 3)})
    except SpecError as e:
        raise click.ClickException(str(e)) from e
    finally:
        disconnect(conn)
    click.echo(result.summary_line())


@main.command("submit")
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--address", required=True, envvar="RAY_API_SERVER_ADDRESS",
              help="Ray dashboard / Jobs API address, e.g. http://HEAD:8265.")
@click.option("--pip", "pip", multiple=True, help="Extra pip requirement for the job's runtime_env (repeatable).")
@click.option("--submission-id", default=None, help="Job id to use (default: generated by Ray).")
@_with_spec_overrides
def submit_cmd(spec, address, pip, submission_id, sets, input_path, output, model, method, drafter, actors,
               gpus_per_actor) -> None:
    """Submit `aggdec run SPEC` to a running Ray cluster through the Ray Jobs API.

    The repository is uploaded as the job's working_dir, so SPEC and the paths in it are resolved
    on the cluster relative to the repository root; the output directory must be storage the
    cluster's head can write (a mounted volume). The spec's fields are checked here first.

    \b
    Examples:
      aggdec submit examples/correct.toml --address http://HEAD:8265
      aggdec submit job.toml --address http://HEAD:8265 --gpus-per-actor 1 --actors 0 --output /mnt/out/job1
      aggdec logs raysubmit_XXXX --address http://HEAD:8265 --follow
    """
    from cluster import jobs_api

    overrides = _overrides(sets, input_path=input_path, output=output, model=model, method=method, drafter=drafter,
                           actors=actors, gpus_per_actor=gpus_per_actor)
    _load_spec(spec, overrides, check_model=False)
    path = Path(spec).resolve()
    try:
        spec_arg = str(path.relative_to(jobs_api.REPO_ROOT))
    except ValueError:
        spec_arg = spec
    run_args = [a for o in overrides for a in ("--set", o)]
    job_id = jobs_api.submit(address, spec_arg, run_args, pip=list(pip) or None, submission_id=submission_id)
    click.echo(job_id)
    click.echo(f"follow with: aggdec logs {job_id} --address {address} --follow", err=True)


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

    click.echo(json.dumps(jobs_api.info(address, job_id), indent=2, default=str))


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
        click.echo(jobs_api.logs(address, job_id), nl=False)
        return
    import asyncio

    async def _follow():
        async for lines in jobs_api.tail_logs(address, job_id):
            click.echo(lines, nl=False)

    asyncio.run(_follow())


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

    stopped = jobs_api.stop(address, job_id)
    click.echo(f"{job_id}: {'stop requested' if stopped else 'not running'}")


if __name__ == "__main__":
    main()
