"""The systems a benchmark times, and the process each one runs in.

A system is named on the command line as

    greedy | iad | gad | gad++ | blockwise | beam [@fp32|@bf16|@int8] [+compile] [/THREADS] [:MODEL]   aggdec
    ct2 | ct2-beam [@COMPUTE] [/THREADS] [:MODEL]          CTranslate2 (COMPUTE: float32, the default, int8, ...)
    transformers | transformers-beam [@fp32|@bf16] [/THREADS] [:MODEL]   transformers `generate` (Hugging Face
                                                           directories; @bf16: the model loaded in bfloat16)
    fairseq | fairseq-beam [/THREADS] [:MODEL]             fairseq-generate (aggdec's models, exported)

`/THREADS` runs the system on that many threads instead of the benchmark's `--threads` (a peer's
best setting can be another than aggdec's: CTranslate2 at batch 1, on some CPUs, is several times
faster on one thread than on two); `:MODEL` runs it on another model than the benchmark's default.

Every system runs in a process of its own, started once and kept while the benchmark runs: the
parent sends it one request per batch size and repeat, in turn with the other systems, so repeats
interleave and no process pays another's start-up. A peer's process imports nothing of aggdec, and
a CTranslate2 process does not import torch either (two threading runtimes in one process slow each
other down): it gets its input as token pieces, tokenized beforehand by the parent. Each reply
lists which of `WATCHED` the process has loaded, and `check_clean` refuses a reply from a peer
whose process loaded what it must not.

This file is also the program those processes run (`python -I bench/systems.py JOB`: a peer's
process then has neither PYTHONPATH nor this folder on its path), so it imports only the standard
library at its top; each kind's libraries are imported in its own runner.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

METHODS = ("greedy", "iad", "gad", "gad++", "blockwise", "beam")
PEERS = ("ct2", "transformers", "fairseq")
PRECISIONS = ("fp32", "bf16", "int8")
TRANSFORMERS_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # @precision -> torch dtype of the model
WATCHED = ("aggdec", "jobs", "cluster", "torch")  # modules whose presence in a process is checked
FORBIDDEN = {"ct2": {"aggdec", "jobs", "cluster", "torch"}, "transformers": {"aggdec", "jobs", "cluster"},
             "fairseq": {"aggdec", "jobs", "cluster"}}


@dataclass(frozen=True)
class System:
    """One system as named on the command line (module docstring)."""

    name: str
    kind: str  # "aggdec" or one of PEERS
    method: str  # aggdec's method; for a peer "greedy" or "beam"
    precision: str = "fp32"  # aggdec: the verifier's precision; CTranslate2: its compute type
    compile: bool = False
    model: str | None = None  # None: the benchmark's default model
    threads: int | None = None  # None: the benchmark's --threads

    @classmethod
    def parse(cls, name: str) -> "System":
        """The system `name` names; ValueError naming what is wrong."""
        spec, _, model = name.partition(":")
        spec, slash, count = spec.partition("/")
        if slash and not (count.isdigit() and int(count) > 0):
            raise ValueError(f"system {name!r}: /{count} is not a thread count")
        threads = int(count) if slash else None
        head, plus, flag = spec.rpartition("+")
        if plus and flag:  # a flag after the last "+" ("gad++" ends in no flag)
            if flag != "compile":
                raise ValueError(f"system {name!r}: unknown flag +{flag} (known: +compile)")
            spec = head
        plus = plus if flag else ""
        base, _, precision = spec.partition("@")
        peer, _, beam = base.partition("-")
        if peer in PEERS:
            if beam not in ("", "beam"):
                raise ValueError(f"system {name!r}: {peer}-{beam} is not a system ({peer} or {peer}-beam)")
            if plus or (precision and peer == "fairseq"):
                raise ValueError(f"system {name!r}: {peer} takes no {'+compile' if plus else '@precision'}")
            if peer == "transformers":
                if precision not in ("", *TRANSFORMERS_DTYPES):
                    raise ValueError(f"system {name!r}: unknown precision {precision!r} for transformers "
                                     f"({', '.join(TRANSFORMERS_DTYPES)})")
                precision = precision or "fp32"
            return cls(name, peer, "beam" if beam else "greedy", precision or "float32", False, model or None, threads)
        if base not in METHODS:
            raise ValueError(f"system {name!r}: unknown method {base!r} (aggdec: {', '.join(METHODS)}; "
                             f"peers: {', '.join(PEERS)})")
        if precision and precision not in PRECISIONS:
            raise ValueError(f"system {name!r}: unknown precision {precision!r} ({', '.join(PRECISIONS)})")
        return cls(name, "aggdec", base, precision or "fp32", bool(plus), model or None, threads)


def check_clean(system: System, modules: list[str]) -> None:
    """Refuse a reply from a peer's process that loaded modules it must not (`FORBIDDEN`)."""
    bad = sorted(FORBIDDEN.get(system.kind, set()) & set(modules))
    if bad:
        raise RuntimeError(f"system {system.name}: its process loaded {', '.join(bad)}; a peer must run in a "
                           "process of its own without them, or its figures are not its own")


START_ENV = dict(os.environ)
"""The harness's environment before it imports aggdec, whose import sets GOMP_SPINCOUNT (aggdec's
__init__): peers and competing processes start from it, so they run as they would on their own."""


class Process:
    """A system's process (`serve` in a child): `request` sends it one decode and waits for the reply."""

    def __init__(self, system: System, job: Path, threads: int, repo: Path):
        env = dict(START_ENV, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
        if system.kind == "aggdec":  # the parent's tree first, and (Python 3.11+) not this folder
            flags = []
            env["PYTHONSAFEPATH"] = "1"
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
        else:  # -I: no PYTHONPATH, no user site, nothing of aggdec within reach but an installed copy
            flags = ["-I"]
        self.system = system
        self.child = subprocess.Popen([sys.executable, *flags, __file__, str(job)], cwd=repo, env=env, text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def request(self, batch_size: int, n: int) -> dict:
        """Decode the first `n` inputs at `batch_size`: {"seconds", "outputs", "modules", ...} or {"error"}."""
        self.child.stdin.write(json.dumps({"batch_size": batch_size, "n": n}) + "\n")
        self.child.stdin.flush()
        line = self.child.stdout.readline()
        if not line:
            return {"error": f"the process exited with status {self.child.wait()}", "modules": []}
        reply = json.loads(line)
        check_clean(self.system, reply["modules"])
        return reply

    def close(self) -> None:
        self.child.stdin.close()
        try:
            self.child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.child.kill()
            self.child.wait()


# -- in the system's process ----------------------------------------------------------------------

Decode = Callable[[int, int], tuple[float, list, dict]]  # (batch size, n) -> (seconds, outputs, extra)


def warm_count(batch_size: int, available: int) -> int:
    """How many inputs a process decodes at a batch size before its first timing."""
    return min(available, max(16, 2 * batch_size))


def aggdec_runner(job: dict) -> Decode:
    """aggdec through its public API: outputs are token ids; extra: verifier calls per sentence."""
    import torch

    from aggdec.api import Translator, decode_options

    torch.set_num_threads(job["threads"])
    tr = Translator.load(job["model"], device=job["device"])
    sources = job["inputs"]
    warmed: set[int] = set()

    def sync() -> None:
        if job["device"].startswith("cuda"):
            torch.cuda.synchronize()

    def decode(bs: int, n: int):
        opts = decode_options(max_batch_size=bs, **job["options"])
        if bs not in warmed:  # conversion, compilation, captures, the draft budget's first estimates
            tr.translate_batch(sources[: warm_count(bs, len(sources))], opts)
            warmed.add(bs)
        sync()
        t0 = time.perf_counter()
        res = tr.translate_batch(sources[:n], opts)
        sync()
        seconds = time.perf_counter() - t0
        failed = [r.error for r in res if r.status == "error"]
        if failed:
            raise RuntimeError(f"{len(failed)} sentences failed: {failed[0]}")
        calls = sum(r.stats.iterations for r in res) / max(1, len(res))
        return seconds, [r.tokens for r in res], {"calls_per_sentence": calls}

    return decode


def ct2_runner(job: dict) -> Decode:
    """CTranslate2 on token pieces: outputs are pieces."""
    import ctranslate2

    tr = ctranslate2.Translator(job["ct2_model"], device=job["device"], compute_type=job["compute"],
                                inter_threads=1, intra_threads=job["threads"])
    pieces = job["inputs"]
    warmed: set[int] = set()

    def run(xs: list, bs: int):
        return tr.translate_batch(xs, beam_size=job["beam"], max_batch_size=bs, max_decoding_length=job["max_len"],
                                  min_decoding_length=1)

    def decode(bs: int, n: int):
        if bs not in warmed:
            run(pieces[: warm_count(bs, len(pieces))], bs)
            warmed.add(bs)
        t0 = time.perf_counter()
        res = run(pieces[:n], bs)
        return time.perf_counter() - t0, [r.hypotheses[0] for r in res], {}

    return decode


def transformers_runner(job: dict) -> Decode:
    """transformers `generate` on length-sorted batches, tokenized by the model's own tokenizer:
    outputs are token ids without the decoder's start, padding and the final eos."""
    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    torch.set_num_threads(job["threads"])
    tok = AutoTokenizer.from_pretrained(job["model"])
    dtype = getattr(torch, TRANSFORMERS_DTYPES[job.get("precision", "fp32")])
    model = AutoModelForSeq2SeqLM.from_pretrained(job["model"], dtype=dtype).to(job["device"]).eval()
    ids = [tok(s).input_ids for s in job["inputs"]]
    limits = job["limits"]
    warmed: set[int] = set()

    def run(rows: list[int], bs: int) -> dict[int, list[int]]:
        out = {}
        order = sorted(rows, key=lambda i: len(ids[i]))
        with torch.inference_mode():
            for start in range(0, len(order), bs):
                batch = order[start: start + bs]
                enc = tok.pad({"input_ids": [ids[i] for i in batch]}, return_tensors="pt").to(job["device"])
                gen = model.generate(**enc, num_beams=job["beam"], do_sample=False, num_return_sequences=1,
                                     max_new_tokens=max(limits[i] for i in batch) + 1)
                for i, row in zip(batch, gen.tolist()):
                    row = [t for t in row[1:] if t != tok.pad_token_id]
                    out[i] = row[:-1] if row and row[-1] == tok.eos_token_id else row
        return out

    def decode(bs: int, n: int):
        if bs not in warmed:
            run(list(range(warm_count(bs, len(ids)))), bs)
            warmed.add(bs)
        if job["device"].startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = run(list(range(n)), bs)
        if job["device"].startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t0, [out[i] for i in range(n)], {}

    return decode


def fairseq_runner(job: dict) -> Decode:
    """fairseq-generate on the binarized inputs (`job["bin"]`: a data folder per input count); the
    time is its own report of decoding, model loading excluded; outputs are pieces."""
    import re

    def decode(bs: int, n: int):
        cmd = [sys.executable, "-m", "fairseq_cli.generate", job["bin"][str(n)], "--path", job["checkpoint"],
               "--source-lang", "src", "--target-lang", "tgt", "--gen-subset", "test", "--beam", str(job["beam"]),
               "--batch-size", str(bs), "--required-batch-size-multiple", "1", "--max-len-a", str(job["max_len_a"]),
               "--max-len-b", str(job["max_len_b"]), "--num-workers", "0", "--cpu"]
        env = dict(os.environ, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")  # our own export: a trusted pickle
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
        hyps: dict[int, list[str]] = {}
        for line in out.stdout.splitlines():
            if line.startswith("H-"):
                head, _, text = line.split("\t", 2)
                hyps[int(head[2:])] = text.split()
        m = re.search(r"Translated [\d,]+ sentences \([\d,]+ tokens\) in ([\d.]+)s", out.stdout + out.stderr)
        if not m:
            raise RuntimeError("fairseq-generate did not report its decoding time")
        return float(m.group(1)), [hyps[i] for i in range(n)], {}

    return decode


RUNNERS = {"aggdec": aggdec_runner, "ct2": ct2_runner, "transformers": transformers_runner, "fairseq": fairseq_runner}


def loaded() -> list[str]:
    """Which of WATCHED this process has imported."""
    return sorted({name.split(".")[0] for name in sys.modules} & set(WATCHED))


def serve(job_path: str) -> int:
    """A system's process: build its runner, then answer one request a line on stdin with one JSON
    line on the stdout it started with (what the libraries print goes to stderr)."""
    job = json.loads(Path(job_path).read_text())
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    try:
        decode: Decode | None = RUNNERS[job["kind"]](job)
        broken = ""
    except Exception as e:  # e.g. a compute type the CPU lacks: every request gets the error
        decode, broken = None, f"{type(e).__name__}: {e}"[:500]
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if decode is None:
                answer = {"error": broken}
            else:
                seconds, outputs, extra = decode(request["batch_size"], request["n"])
                answer = {"seconds": seconds, "outputs": outputs, **extra}
        except Exception as e:
            answer = {"error": f"{type(e).__name__}: {e}"[:500]}
        reply.write(json.dumps({**answer, "modules": loaded()}) + "\n")
        reply.flush()
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1]))
