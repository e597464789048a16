"""One results format for every benchmark, and the markdown tables made from it.

A results file is one JSON object: `format`, `kind` (the subcommand), `command` (as typed, paths
relative to the repository or its parent), `machine` (CPU model and instruction-set class, cores,
GPU), `versions` (Python and the libraries), `commit` (and whether the tree differed from it),
`date`, `settings` and `runs` (one object per measurement). `Results` rewrites the file whole after
every run, so a benchmark stopped early keeps what it measured; `table` turns a file into the
markdown table docs/benchmarks.md shows, so the document is regenerated, not retyped.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

FORMAT = "aggdec-bench v1"
REPO = Path(__file__).resolve().parent.parent
LIBRARIES = {"torch": ("torch",), "ctranslate2": ("ctranslate2",), "transformers": ("transformers",),
             "fairseq": ("fairseq", "fairseq-fixed"), "sentencepiece": ("sentencepiece",), "ray": ("ray",),
             "aggdec": ("aggdec",)}


def shown(arg: str) -> str:
    """A command-line argument as recorded: a path inside the repository or its parent relative to
    the repository (`../shared/...`), anything else as typed."""
    key, eq, value = arg.partition("=") if arg.startswith("-") else ("", "", arg)
    path = Path(value).expanduser()
    if value and path.exists():
        p = path.resolve()
        for base, prefix in ((REPO, ""), (REPO.parent, "../")):
            if p.is_relative_to(base):
                value = prefix + str(p.relative_to(base)) or "."
                break
    return key + eq + value


def without_work(argv: list[str]) -> list[str]:
    """`argv` less `--work FOLDER` (a scratch folder of this machine, which changes no figure)."""
    out, skip = [], False
    for arg in argv:
        if not skip and arg != "--work" and not arg.startswith("--work="):
            out.append(arg)
        skip = arg == "--work"
    return out


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: str) -> dict[str, Any]:
    """What a benchmark ran on: the CPU, its class (aggdec.model.precision.cpu_isa), its cores, and
    the GPU's name when `device` is a GPU."""
    from aggdec.model.precision import cpu_isa

    gpu = None
    if device.startswith("cuda"):
        import torch

        gpu = torch.cuda.get_device_name(torch.device(device))
    return {"cpu": cpu_name(), "cpu_isa": cpu_isa(), "cores": os.cpu_count(), "gpu": gpu}


def versions() -> dict[str, str | None]:
    """Python's version and each library's installed version (None: not installed)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name, dists in LIBRARIES.items():
        out[name] = None
        for dist in dists:
            try:
                out[name] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return out


def commit() -> dict[str, Any]:
    """The repository's commit, and whether tracked files differed from it (None: not a git tree)."""
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True,
                                  text=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    sha = git("rev-parse", "--short=12", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if sha else None
    return {"commit": sha, "modified": None if status is None else bool(status)}


class Results:
    """A results file being written (module docstring); `path` None prints the runs only."""

    def __init__(self, path: Path | None, kind: str, settings: dict[str, Any], device: str = "cpu"):
        self.path = path
        self.head = {"format": FORMAT, "kind": kind,
                     "command": "python -m bench " + shlex.join(shown(a) for a in without_work(sys.argv[1:])),
                     "machine": machine(device), "versions": versions(), **commit(),
                     "date": datetime.date.today().isoformat(), "settings": settings}
        self.runs: list[dict[str, Any]] = []
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, run: dict[str, Any]) -> None:
        """Record one run: print it and rewrite the file."""
        self.runs.append(run)
        print(json.dumps({k: v for k, v in run.items() if not isinstance(v, list)}), flush=True)
        self.write()

    def write(self) -> None:
        if self.path is not None:
            self.path.write_text(json.dumps({**self.head, "runs": self.runs}, indent=1) + "\n", encoding="utf-8")

    @property
    def failed(self) -> bool:
        return any("error" in r for r in self.runs)


def load(path: str | Path) -> dict[str, Any]:
    """A results file; ValueError naming the file when it is not one."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a results file of `python -m bench` (format {FORMAT!r})")
    return data


# -- tables ---------------------------------------------------------------------------------------

def _cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.1f}"
    return str(value)


def _share(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%".replace(".0%", "%")


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _compare(data: dict, systems: list[str] | None) -> str:
    """Rows (model, system) of `systems` (default: all), a column per batch size: sentences/s and the
    ratio to the reference system (on its model) at that batch size, and a `/best` search's layout
    there ("at 2x1"); the least identical share; BLEU at the largest batch size."""
    runs = data["runs"]
    sizes = sorted({r["batch_size"] for r in runs})
    by = {(r["model"], r["system"], r["batch_size"]): r for r in runs}
    reference = data["settings"]["reference"]
    model = next((r["model"] for r in runs if r["system"] == reference), None)
    base = {bs: by.get((model, reference, bs)) for bs in sizes}
    keys = list(dict.fromkeys((r["model"], r["system"]) for r in runs))
    if systems:
        keys = sorted((k for k in keys if k[1] in systems), key=lambda k: systems.index(k[1]))
    runs = [r for r in runs if (r["model"], r["system"]) in keys]
    rows = []
    for model, system in keys:
        cells = [model, system.split(":")[0]]
        for bs in sizes:
            r, b = by.get((model, system, bs)), base[bs]
            if r is None or "error" in r:
                cells.append("failed" if r else "—")
                continue
            ratio = f" ({r['sentences_per_s'] / b['sentences_per_s']:.2f}x)" if b and "error" not in b else ""
            at = f" at {r['layout']}" if "best" in r else ""
            cells.append(f"{r['sentences_per_s']:,.1f}{ratio}{at}")
        done = [by[(model, system, bs)] for bs in sizes if "error" not in by.get((model, system, bs), {"error": 0})]
        shares = [r["identical"] for r in done if r.get("identical") is not None]
        cells.append(_share(min(shares)) if shares else "—")
        if any("bleu" in r for r in runs):
            cells.append(_cell(done[-1].get("bleu")) if done else "—")
        rows.append(cells)
    beam = " (beam: to beam)" if any("beam" in s for _, s in keys) else ""
    header = ["model", "system", *(f"batch {bs}" for bs in sizes), f"identical to {reference}{beam}"]
    return _markdown(header + (["BLEU"] if any("bleu" in r for r in runs) else []), rows)


def _contention(data: dict) -> str:
    n = data["settings"]["competitors"]
    rows = [[r["model"], r["system"], str(r["batch_size"]), _cell(r.get("quiet_sentences_per_s")),
             _cell(r.get("contended_sentences_per_s")), _share(r.get("kept")) if "error" not in r else r["error"]]
            for r in data["runs"]]
    return _markdown(["model", "system", "batch", "quiet sent/s", f"beside {n} competing processes", "kept"], rows)


def _gpu(data: dict) -> str:
    """The environment in a line, then a row per measured run of the GPU check."""
    env = next((r for r in data["runs"] if r.get("section") == "environment"), {})
    rows = []
    for r in data["runs"]:
        if r.get("section") == "environment":
            continue
        same = r.get("identical_to_greedy", r.get("identical", r.get("identical_to_api")))
        rows.append([r["section"], r.get("model", "—"), r.get("method") or r.get("system", "—"),
                     r.get("precision", "—"), str(r.get("batch_size", "—")),
                     r["error"] if "error" in r else _cell(r.get("sentences_per_s")), _share(same),
                     _share(r.get("identical_to_cpu_greedy")), _cell(r.get("captures_after_warm_up")),
                     _cell(r.get("peak_memory_mb"))])
    head = ", ".join(f"{k} {_cell(v)}" for k, v in env.items() if k != "section")
    return head + "\n\n" + _markdown(["section", "model", "system", "precision", "batch", "sent/s", "identical",
                                      "to CPU greedy", "captures after warm-up", "peak MB"], rows)


def _roofline(data: dict) -> str:
    """A row per layout: its ceiling, and the systems measured at that layout with their shares of it."""
    rows = []
    for r in (r for r in data["runs"] if "ceiling_sentences_per_s" in r):
        at = [s for s in data["runs"] if s.get("layout") == r["layout"] and "share_of_ceiling" in s]
        measured = ", ".join(f"{s['system']} {_cell(s['sentences_per_s'])} ({_share(s['share_of_ceiling'])})"
                             for s in sorted(at, key=lambda s: -s["share_of_ceiling"]))
        rows.append([r["layout"], f"{r['step_weights_mb']:.1f} MB", _cell(r["us_per_step"]), _cell(r["gb_per_s"]),
                     _cell(r["steps_per_sentence"]), _cell(r["ceiling_sentences_per_s"]), measured or "—"])
    return _markdown(["layout", "a step's weights", "µs a step", "GB/s", "steps a sentence", "ceiling sent/s",
                      "measured (share of the ceiling)"], rows)


def _generic(data: dict) -> str:
    """Every scalar field of the runs, in the order they first appear."""
    keys = list(dict.fromkeys(k for r in data["runs"] for k, v in r.items() if not isinstance(v, (list, dict))))
    return _markdown(keys, [[_cell(r.get(k)) for k in keys] for r in data["runs"]])


MARKED = re.compile(r"(<!-- bench table: (\S+?)(?: systems=(\S+))? -->\n).*?(<!-- end bench table -->)", re.S)


def table(data: dict[str, Any], systems: list[str] | None = None) -> str:
    """A results file's runs as a markdown table, with the machine and command beneath it; `systems`:
    only those systems' runs, in that order."""
    if data["kind"] == "compare":
        body = _compare(data, systems)
    elif data["kind"] == "roofline":
        body = _roofline(data)
    else:
        if systems:
            data = {**data, "runs": sorted((r for r in data["runs"] if r.get("system") in systems),
                                           key=lambda r: systems.index(r["system"]))}
        body = {"contention": _contention, "gpu": _gpu}.get(data["kind"], _generic)(data)
    m, v = data["machine"], data["versions"]
    where = m["gpu"] or f"{m['cpu']} (`{m['cpu_isa']}`, {m['cores']} cores)"
    libs = ", ".join(f"{k} {val}" for k, val in v.items() if val and k in ("torch", "ctranslate2", "transformers",
                                                                            "fairseq"))
    threads = data["settings"].get("threads")
    return (f"{body}\n\n{where}{f', {threads} threads' if threads else ''}; {libs}; commit "
            f"`{data['commit']}`{' (modified)' if data['modified'] else ''}, {data['date']}.\n"
            f"`{data['command']}`")


def update(doc: Path) -> list[str]:
    """Rewrite each table of `doc` marked `<!-- bench table: FILE [systems=A,B] -->` ... `<!-- end
    bench table -->` from its results file (a path from the repository's root); -> the files that
    are not there yet, whose tables are left as they are."""
    missing: list[str] = []

    def fill(m: re.Match) -> str:
        path = REPO / m.group(2)
        if not path.is_file():
            missing.append(m.group(2))
            return m.group(0)
        systems = m.group(3).split(",") if m.group(3) else None
        return f"{m.group(1)}{table(load(path), systems)}\n{m.group(4)}"

    text = doc.read_text(encoding="utf-8")
    doc.write_text(MARKED.sub(fill, text), encoding="utf-8")
    return missing
