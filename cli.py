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


if __name__ == "__main__":
    main()
