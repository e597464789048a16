"""The systems a benchmark times, and the process each one runs in.

A system is named on the command line as

    greedy | iad | gad | gad++ | blockwise | beam [@fp32|@bf16|@int8] [+compile|+auto] [/LAYOUT] [:MODEL]   aggdec
    ct2 | ct2-beam [@COMPUTE] [/LAYOUT] [:MODEL]           CTranslate2 (COMPUTE: float32, the default, int8, ...)
    transformers | transformers-beam [@fp32|@bf16] [/THREADS] [:MODEL]   transformers `generate` (Hugging Face
                                                           directories; @bf16: the model loaded in bfloat16)
    fairseq | fairseq-beam [/THREADS] [:MODEL]             fairseq-generate (aggdec's models, exported)

`/THREADS` runs the system on that many threads instead of the benchmark's `--threads` (a peer's
best setting can be another than aggdec's: CTranslate2 at batch 1, on some CPUs, is several times
faster on one thread than on two); `:MODEL` runs it on another model than the benchmark's default.
`/LAYOUT` is `/THREADS`, `/PxT` or `/best`:

- `/PxT` runs P workers of T threads each. CTranslate2: one process with `inter_threads=P,
  intra_threads=T`, given each request's inputs at once (`max_batch_size` = the batch size), so
  that its P workers decode its batches in parallel. aggdec: P processes of T threads, each
  decoding its contiguous share of each request's inputs (`share`), all sent their request
  together; the time is the slower one's (`Process.request`). `/T` is `/1xT`.
- `/best` stands for every layout on the benchmark's `--threads` cores (`layouts`: P * T <=
  --threads), each a system of its own named `SPEC/PxT[:MODEL]` (`System.expand`); `compare`
  also reports, per batch size, the fastest of them under the `/best` name.

Every system runs in a process of its own (aggdec's `/PxT`: in P), started once and kept while the
benchmark runs: the parent sends it one request per batch size and repeat, in turn with the other
systems, so repeats interleave and no process pays another's start-up. A peer's process imports
nothing of aggdec, and a CTranslate2 process does not import torch either (two threading runtimes in
one process slow each other down): it gets its input as token pieces, tokenized beforehand by the
parent. Each reply lists which of `WATCHED` the process has loaded, and `check_clean` refuses a
reply from a peer whose process loaded what it must not.

This file is also the program those processes run (`python -I bench/systems.py JOB PART PARTS`: a
peer's process then has neither PYTHONPATH nor this folder on its path), so it imports only the
standard library at its top; each kind's libraries are imported in its own runner.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

METHODS = ("greedy", "iad", "gad", "gad++", "blockwise", "beam")
PEERS = ("ct2", "transformers", "fairseq")
PRECISIONS = ("fp32", "bf16", "int8")
TRANSFORMERS_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # @precision -> torch dtype of the model
WATCHED = ("aggdec", "jobs", "cluster", "torch")  # modules whose presence in a process is checked
FORBIDDEN = {"ct2": {"aggdec", "jobs", "cluster", "torch"}, "transformers": {"aggdec", "jobs", "cluster"},
             "fairseq": {"aggdec", "jobs", "cluster"}}
LAYOUT_KINDS = ("aggdec", "ct2")  # the kinds that run a /PxT layout with P > 1, and so /best


def layouts(cores: int) -> list[tuple[int, int]]:
    """Every layout (workers P, threads T each) with P * T <= `cores`, by P, then T."""
    return [(p, t) for p in range(1, cores + 1) for t in range(1, cores // p + 1)]


def parse_layout(name: str, text: str) -> tuple[int | None, int, bool]:
    """`/text` of system `name` (module docstring): (threads, workers, search); ValueError naming it."""
    if text == "best":
        return None, 1, True
    workers, x, threads = text.partition("x")
    if not x:
        workers, threads = "1", text
    if not (workers.isdigit() and threads.isdigit() and int(workers) > 0 and int(threads) > 0):
        raise ValueError(f"system {name!r}: /{text} is not a thread count (/N), a layout (/PxT, P and T "
                         "positive) or /best")
    return int(threads), int(workers), False


@dataclass(frozen=True)
class System:
    """One system as named on the command line (module docstring)."""

    name: str
    kind: str  # "aggdec" or one of PEERS
    method: str  # aggdec's method; for a peer "greedy" or "beam"
    precision: str = "fp32"  # aggdec: the verifier's precision; CTranslate2: its compute type
    compile: bool | str = False  # aggdec: the `compile` option (+compile: True, +auto: "auto", else False)
    model: str | None = None  # None: the benchmark's default model
    threads: int | None = None  # each worker's; None: the benchmark's --threads
    workers: int = 1  # CTranslate2: inter_threads; aggdec: processes, each decoding its share
    search: bool = False  # /best: stands for its layouts (`expand`), runs none itself
    searched: str | None = None  # the /best system this one is a layout of

    @classmethod
    def parse(cls, name: str) -> "System":
        """The system `name` names; ValueError naming what is wrong."""
        spec, _, model = name.partition(":")
        spec, slash, layout = spec.partition("/")
        threads, workers, search = parse_layout(name, layout) if slash else (None, 1, False)
        head, plus, flag = spec.rpartition("+")
        if plus and flag:  # a flag after the last "+" ("gad++" ends in no flag)
            if flag not in ("compile", "auto"):
                raise ValueError(f"system {name!r}: unknown flag +{flag} (known: +compile, +auto)")
            spec = head
        plus = plus if flag else ""
        base, _, precision = spec.partition("@")
        peer, _, beam = base.partition("-")
        if peer in PEERS:
            if beam not in ("", "beam"):
                raise ValueError(f"system {name!r}: {peer}-{beam} is not a system ({peer} or {peer}-beam)")
            if plus or (precision and peer == "fairseq"):
                raise ValueError(f"system {name!r}: {peer} takes no {'+' + flag if plus else '@precision'}")
            if peer == "transformers":
                if precision not in ("", *TRANSFORMERS_DTYPES):
                    raise ValueError(f"system {name!r}: unknown precision {precision!r} for transformers "
                                     f"({', '.join(TRANSFORMERS_DTYPES)})")
                precision = precision or "fp32"
            if (workers > 1 or search) and peer not in LAYOUT_KINDS:
                raise ValueError(f"system {name!r}: {peer} runs on one worker: /THREADS, not /{layout}")
            return cls(name, peer, "beam" if beam else "greedy", precision or "float32", False, model or None, threads,
                       workers, search)
        if base not in METHODS:
            raise ValueError(f"system {name!r}: unknown method {base!r} (aggdec: {', '.join(METHODS)}; "
                             f"peers: {', '.join(PEERS)})")
        if precision and precision not in PRECISIONS:
            raise ValueError(f"system {name!r}: unknown precision {precision!r} ({', '.join(PRECISIONS)})")
        compile = {"compile": True, "auto": "auto"}.get(flag, False) if plus else False
        return cls(name, "aggdec", base, precision or "fp32", compile, model or None, threads, workers, search)

    def expand(self, cores: int) -> list["System"]:
        """The systems this one stands for on `cores` threads: a /best search's layouts (`layouts`),
        each named `SPEC/PxT[:MODEL]` with `searched` its name; any other system, itself."""
        if not self.search:
            return [self]
        spec, colon, model = self.name.partition(":")
        base = spec.removesuffix("/best")
        return [replace(self, name=f"{base}/{p}x{t}{colon}{model}", threads=t, workers=p, search=False,
                        searched=self.name) for p, t in layouts(cores)]

    def layout(self, cores: int) -> str:
        """`PxT`: its workers and each one's threads (`cores`: the benchmark's --threads)."""
        return f"{self.workers}x{self.threads or cores}"


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
    """A system's process (`serve` in a child; aggdec's `/PxT`: P of them, each decoding its share):
    `request` sends it one decode and waits for the reply."""

    def __init__(self, system: System, job: Path, threads: int, repo: Path):
        env = dict(START_ENV, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
        if system.kind == "aggdec":  # the parent's tree first, and (Python 3.11+) not this folder
            flags = []
            env["PYTHONSAFEPATH"] = "1"
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
        else:  # -I: no PYTHONPATH, no user site, nothing of aggdec within reach but an installed copy
            flags = ["-I"]
        self.system = system
        parts = system.workers if system.kind == "aggdec" else 1  # CTranslate2's workers are its own threads
        self.children = [subprocess.Popen([sys.executable, *flags, __file__, str(job), str(part), str(parts)],
                                          cwd=repo, env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                         for part in range(parts)]
        self.warm: set[int] = set()  # batch sizes every child has warmed up at (several children only)

    def request(self, batch_size: int, n: int) -> dict:
        """Decode the first `n` inputs at `batch_size`: {"seconds", "outputs", "modules", ...} or {"error"}.

        Several children each get the request at once (written to all before any reply is read) and
        decode their share; before the first at a batch size, a round of no inputs lets each warm up
        on its own, so that the timed round starts them together, warm. The replies are `merged`."""
        if len(self.children) > 1 and batch_size not in self.warm:
            warm = merged(self._round(batch_size, 0))
            if "error" in warm:
                return warm
            self.warm.add(batch_size)
        return merged(self._round(batch_size, n))

    def _round(self, batch_size: int, n: int) -> list[dict]:
        """Each child's reply to one request; an error reply from a child that has exited (killed for
        memory, say), before or while it was asked."""
        for child in self.children:
            try:
                child.stdin.write(json.dumps({"batch_size": batch_size, "n": n}) + "\n")
                child.stdin.flush()
            except BrokenPipeError:
                pass  # it exited: its empty reply below says so
        replies = []
        for child in self.children:
            line = child.stdout.readline()
            if not line:
                replies.append({"error": f"the process exited with status {child.wait()}", "modules": []})
                continue
            replies.append(json.loads(line))
            check_clean(self.system, replies[-1]["modules"])
        return replies

    def close(self) -> None:
        for child in self.children:
            try:
                child.stdin.close()
            except BrokenPipeError:
                pass  # it exited already
        for child in self.children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def share(n: int, part: int, parts: int) -> slice:
    """The rows of the first `n` inputs that process `part` of `parts` decodes: contiguous, in
    order, sizes differing by at most one."""
    return slice(part * n // parts, (part + 1) * n // parts)


def merged(replies: list[dict]) -> dict:
    """One reply from the replies of a system's processes, in part order: the first error, named by
    its process; else seconds: the slowest process's (they started together), outputs in input
    order, every other figure averaged over sentences, and "process_seconds": each one's time."""
    if len(replies) == 1:
        return replies[0]
    modules = sorted({m for r in replies for m in r["modules"]})
    for part, r in enumerate(replies):
        if "error" in r:
            return {"error": f"process {part + 1} of {len(replies)}: {r['error']}", "modules": modules}
    outputs = [o for r in replies for o in r["outputs"]]
    figures = {key: sum(r[key] * len(r["outputs"]) for r in replies) / max(1, len(outputs))
               for key in replies[0].keys() - {"seconds", "outputs", "modules"}}
    return {"seconds": max(r["seconds"] for r in replies), "outputs": outputs, **figures,
            "process_seconds": [r["seconds"] for r in replies], "modules": modules}


# -- in the system's process ----------------------------------------------------------------------

Decode = Callable[[int, int], tuple[float, list, dict]]  # (batch size, n) -> (seconds, outputs, extra)


def warm_count(batch_size: int, available: int) -> int:
    """How many inputs a process decodes at a batch size before its first timing."""
    return min(available, max(16, 2 * batch_size))


def aggdec_runner(job: dict) -> Decode:
    """aggdec through its public API, on this process's `share` of each request's inputs (`job`'s
    "part" of "parts"): outputs are token ids; extra: verifier calls per sentence."""
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
        if bs not in warmed and not job.get("cold"):  # conversion, compilation, captures, the budget's first estimates
            tr.translate_batch(sources[: warm_count(bs, len(sources))], opts)
            warmed.add(bs)
        sync()
        t0 = time.perf_counter()
        res = tr.translate_batch(sources[share(n, job["part"], job["parts"])], opts)
        sync()
        seconds = time.perf_counter() - t0
        failed = [r.error for r in res if r.status == "error"]
        if failed:
            raise RuntimeError(f"{len(failed)} sentences failed: {failed[0]}")
        calls = sum(r.stats.iterations for r in res) / max(1, len(res))
        return seconds, [r.tokens for r in res], {"calls_per_sentence": calls}

    return decode


def ct2_runner(job: dict) -> Decode:
    """CTranslate2 on token pieces, `job["workers"]` batches at a time: outputs are pieces, beginning with
    `job["target_prefix"]` where it has pieces (the tokens the model forces first: M2M100's target language).

    Each request's inputs go to `translate_batch` at once with `max_batch_size` = the batch size:
    CTranslate2 sorts them by length, cuts them into batches and queues each as a job of its own
    for its `inter_threads` workers (ReplicaPool::post_examples), so P workers decode P batches in
    parallel; the results come back in input order."""
    import ctranslate2

    tr = ctranslate2.Translator(job["ct2_model"], device=job["device"], compute_type=job["compute"],
                                inter_threads=job["workers"], intra_threads=job["threads"])
    pieces, prefix = job["inputs"], job.get("target_prefix")
    warmed: set[int] = set()

    def run(xs: list, bs: int):
        return tr.translate_batch(xs, target_prefix=[prefix] * len(xs) if prefix else None, beam_size=job["beam"],
                                  max_batch_size=bs, batch_type="examples", max_decoding_length=job["max_len"],
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


def serve(job_path: str, part: int = 0, parts: int = 1) -> int:
    """A system's process, `part` of `parts`: build its runner, then answer one request a line on
    stdin with one JSON line on the stdout it started with (what the libraries print goes to stderr)."""
    job = json.loads(Path(job_path).read_text()) | {"part": part, "parts": parts}
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
    sys.exit(serve(sys.argv[1], *map(int, sys.argv[2:])))
