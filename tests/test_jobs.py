"""Corpus jobs on a real local Ray (2 CPUs) with real Parquet files and the tiny model fixture."""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402
from conftest import synthetic_sentences  # noqa: E402

from aggdec.api import Translator  # noqa: E402
from cluster.resources import plan_actors  # noqa: E402
from jobs.inputs import inspect_inputs  # noqa: E402
from jobs.run import run_job  # noqa: E402
from jobs.spec import SpecError, load_spec  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SHARDS, ROWS = 3, 20


@pytest.fixture(scope="module")
def ray_local():
    os.environ["RAY_AUTH_MODE"] = "disabled"
    # "local": a Ray of its own, never the cluster another test's `ray start` recorded in Ray's temp directory
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def write_corpus(root: Path, shards: int = SHARDS, rows: int = ROWS, seed: int = 1) -> Path:
    """`shards` Parquet files part-0000k.parquet with columns src, ref (string), n (int64)."""
    root.mkdir(parents=True, exist_ok=True)
    texts = synthetic_sentences(shards * rows, seed)
    for k in range(shards):
        chunk = texts[k * rows:(k + 1) * rows]
        pq.write_table(pa.table({"src": chunk, "ref": [t.lower() for t in chunk], "n": list(range(k * rows, (k + 1) * rows))}),
                       root / f"part-{k:05d}.parquet")
    return root


def write_spec(path: Path, model: Path, inp: Path, out: Path, **sections) -> Path:
    """A spec file; `sections` maps section name -> {key: TOML literal}. One unit per file unless
    `batching` says otherwise (these corpora's files are small enough to pack)."""
    lines = ['kind = "correct"', f'model = "{model}"', "[input]", f'path = "{inp}"', "[output]", f'dir = "{out}"']
    sections = {"batching": {"pack_rows": "0"}, **sections}
    for name, fields in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {v}" for k, v in fields.items()]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def read_outputs(out: Path) -> pa.Table:
    return pa.concat_tables(pq.read_table(p) for p in sorted(out.glob("part-*.parquet")))


def run_on_new_ray(spec, out: Path) -> tuple:
    """Run `spec` on a Ray started for it (and shut down after) -> (JobResult, its outputs)."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        result = run_job(spec)
    finally:
        ray.shutdown()
    return result, read_outputs(out)


def in_process(model: Path, texts: list[str], spec) -> list:
    return Translator.load(model).translate_batch(texts, spec.decode)


def test_end_to_end_then_resume_after_killed_driver(ray_local, tiny_model_dir, tmp_path):
    inp = write_corpus(tmp_path / "in")
    out = tmp_path / "out"
    spec = load_spec(write_spec(tmp_path / "job.toml", tiny_model_dir, inp, out,
                                resources={"actors": "2"}, decode={"method": '"iad"', "draft_length": '"max"'}))  # per-row stats: deterministic lengths
    result = run_job(spec)

    # rows in == rows out, ids unique, one file + marker per shard, row order = input order
    table = read_outputs(out)
    assert result.rows == table.num_rows == SHARDS * ROWS and result.decoded_rows == SHARDS * ROWS
    assert len(set(table.column("id").to_pylist())) == table.num_rows
    assert table.column("n").to_pylist() == list(range(SHARDS * ROWS))
    assert sorted(p.name for p in out.glob("_SUCCESS.*")) == [f"_SUCCESS.part-{k:05d}" for k in range(SHARDS)]
    assert not list(out.glob(".*.tmp"))
    assert table.column_names == ["id", "src", "hyp", "ref", "n", "status", "error", "method", "src_len", "hyp_len",
                                  "iterations", "drafted", "accepted", "accepted_per_iter", "decode_ms"]
    assert table.schema.field("accepted_per_iter").type == pa.list_(pa.int32())
    assert table.column("id").to_pylist()[:2] == ["part-00000:0", "part-00000:1"]
    assert set(table.column("method").to_pylist()) == {"iad"}

    # outputs equal in-process decoding of the same sentences with the same options
    src = table.column("src").to_pylist()
    ref = in_process(tiny_model_dir, src, spec)
    assert table.column("hyp").to_pylist() == [r.text for r in ref]
    assert table.column("status").to_pylist() == [r.status for r in ref]
    assert table.column("hyp_len").to_pylist() == [len(r.tokens) for r in ref]
    assert table.column("accepted").to_pylist() == [r.stats.accepted for r in ref]

    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["complete"] and manifest["totals"]["rows"] == SHARDS * ROWS
    assert manifest["totals"]["ok"] == result.ok == sum(r.status == "ok" for r in ref)
    assert manifest["model"]["sha"] == Translator.load(tiny_model_dir).bundle.sha
    assert "|method:iad|" in manifest["signature"] and manifest["signature"].endswith(manifest["model"]["sha"])
    assert manifest["totals"]["speedup"]["accepted"] == sum(r.stats.accepted for r in ref)
    assert manifest["timings"]["actors"]["actors"] == 2 and manifest["aggdec_version"]
    # each unit's record says which backend decoded it on which actor (a few rows: eager, nothing compiled)
    assert {tuple(r["backends"]) for r in manifest["shards"].values()} == {("eager",)}
    assert manifest["totals"]["backends"] == result.backends and result.backends["eager"] in (1, 2)
    assert manifest["totals"]["compile_s"] == result.compile_seconds == 0
    assert f"; backend eager on {result.backends['eager']} actor" in result.summary_line()
    first = {p.name: p.read_bytes() for p in out.glob("part-*.parquet")}

    # "kill" the driver: shard 1 left as output without marker (partial), shard 2 lost, a stale tmp file
    (out / "_SUCCESS.part-00001").unlink()
    (out / "part-00002.parquet").unlink()
    (out / "_SUCCESS.part-00002").unlink()
    (out / ".part-00002.parquet.tmp").write_bytes(b"half a parquet file")
    rerun = run_job(spec)
    assert rerun.skipped == ["part-00000"] and sorted(rerun.committed) == ["part-00001", "part-00002"]
    assert rerun.decoded_rows == 2 * ROWS and rerun.rows == SHARDS * ROWS
    again = read_outputs(out)
    assert again.num_rows == SHARDS * ROWS and len(set(again.column("id").to_pylist())) == SHARDS * ROWS
    assert again.column("hyp").to_pylist() == table.column("hyp").to_pylist()
    assert (out / "part-00000.parquet").read_bytes() == first["part-00000.parquet"]  # untouched
    assert not list(out.glob(".*.tmp"))
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["run"]["stale_tmp_deleted"] == [".part-00002.parquet.tmp"]
    assert manifest["totals"]["rows"] == SHARDS * ROWS

    # everything committed: no Ray work at all
    done = run_job(spec)
    assert done.decoded_rows == 0 and done.skipped == [f"part-{k:05d}" for k in range(SHARDS)]

    # the same output dir with another method is refused, not mixed
    with pytest.raises(SpecError, match="different job"):
        run_job(load_spec(None, [f"model={tiny_model_dir}", f"input.path={inp}", f"output.dir={out}",
                                 "decode.method=greedy"]))


def kill_once_worker(marker: Path) -> type:
    """A DecodeWorker whose first call anywhere creates `marker` and kills its own process (defined in a
    function, so Ray ships the class by value to the actors)."""
    from cluster.actors import DecodeWorker

    class KillOnce(DecodeWorker):
        def __call__(self, batch):
            try:
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return super().__call__(batch)
            os.close(fd)
            os._exit(1)

    return KillOnce


def test_actor_killed_once_every_row_exactly_once(ray_local, tiny_model_dir, tmp_path, monkeypatch):
    inp = write_corpus(tmp_path / "in", seed=2)
    out = tmp_path / "out"
    marker = tmp_path / "killed-once"
    spec = load_spec(write_spec(tmp_path / "job.toml", tiny_model_dir, inp, out, resources={"actors": "1"},
                                decode={"method": '"greedy"'}))
    monkeypatch.setattr("cluster.actors.DecodeWorker", kill_once_worker(marker))
    warned: list[str] = []
    result = run_job(spec, warn=warned.append)
    assert marker.is_file()  # an actor did call os._exit(1) on its first batch
    # the pool's only actor died with its unit: the driver redid the units that had not committed
    assert result.attempts == 2 and len(warned) == 2, warned
    assert warned[0] == f"decoding {SHARDS * ROWS} rows in {SHARDS} unit(s) with 1 actor(s) on cpu (1 CPU, 1 thread(s) each); method greedy"
    assert re.match(r"lost a decode actor \(\w+\); redoing the \d+ unit\(s\) that did not commit", warned[1]), warned
    table = read_outputs(out)
    assert table.num_rows == result.rows == SHARDS * ROWS
    assert sorted(table.column("n").to_pylist()) == list(range(SHARDS * ROWS))
    assert len(set(table.column("id").to_pylist())) == SHARDS * ROWS
    ref = in_process(tiny_model_dir, table.column("src").to_pylist(), spec)
    assert table.column("hyp").to_pylist() == [r.text for r in ref]


def test_malformed_rows_become_status_rows(ray_local, tiny_model_dir, tmp_path):
    inp = tmp_path / "in"
    inp.mkdir()
    rows = ["", "   \t  ", None, "the cat \x00 goes\x07 to\x1b school .", "long " * 400,
            "caf\u00e9 \u4e2d\u6587 \U0001f600 \u202eabc", "the dog runs ."]
    pq.write_table(pa.table({"text": pa.array(rows, pa.string()), "key": list(range(100, 100 + len(rows)))}),
                   inp / "weird.parquet")
    out = tmp_path / "out"
    spec = load_spec(None, [f"model={tiny_model_dir}", f"input.path={inp}", f"output.dir={out}",
                            "input.text_column=text", "input.id_column=key", "decode.method=iad"])
    result = run_job(spec)
    table = pq.read_table(out / "weird.parquet")
    assert table.column("id").to_pylist() == [str(k) for k in range(100, 100 + len(rows))]
    assert table.column("status").to_pylist() == ["empty", "empty", "empty", "ok", "truncated", "lost_characters", "ok"]
    assert "U+202E RIGHT-TO-LEFT OVERRIDE" in table.column("error")[5].as_py()  # the tiny vocabulary lacks it
    assert result.status["lost_characters"] == 1  # counted in the summary
    assert table.column("hyp").to_pylist()[:3] == ["", "", ""]
    assert table.column("src").to_pylist() == rows  # stored input, not the cleaned text
    assert result.rows == len(rows) and result.errors == 0


def test_surrogates_cannot_be_stored_but_the_engine_handles_them(tiny_model_dir):
    with pytest.raises((UnicodeEncodeError, pa.ArrowException)):
        pa.array(["bad \ud800 text"], pa.string())
    [res] = Translator.load(tiny_model_dir).translate_batch(["the cat \ud800 runs ."], method="greedy")
    assert res.status == "ok" and "\ud800" not in res.source and res.source.startswith("the cat ")


def test_decode_worker_turns_a_failing_row_into_an_error_row(tiny_model_dir, tmp_path):
    from aggdec.api import decode_options
    from cluster.actors import DecodeWorker
    from jobs.units import plan_units
    from jobs.work import UnitTask

    inp = write_corpus(tmp_path / "in", shards=1, rows=3)
    [shard] = inspect_inputs(load_spec(None, [f"model={tiny_model_dir}", f"input.path={inp}", f"output.dir={tmp_path}"]))
    [unit] = plan_units([shard], 4096)
    task = UnitTask(output=str(tmp_path / "out"), text_column="src", id_column=None, passthrough=shard.passthrough,
                    method="greedy", fingerprint={"job": 1})
    (tmp_path / "out").mkdir()
    worker = DecodeWorker(str(tiny_model_dir), decode_options("greedy"), task)
    run = worker.translator._run

    def flaky(reqs, opts):
        if any(r.index == 1 for r in reqs):
            raise RuntimeError("boom on row 1")
        return run(reqs, opts)

    worker.translator._run = flaky
    [record] = [json.loads(r) for r in worker({"unit": np.array([unit.to_json()], dtype=object)}).column("record").to_pylist()]
    assert record["status"] == {"ok": 2, "error": 1} and record["rows"] == 3
    out = pq.read_table(tmp_path / "out" / "part-00000.parquet")
    assert out.column("status").to_pylist() == ["ok", "error", "ok"]
    assert "boom on row 1" in out.column("error")[1].as_py()
    assert out.column("n").to_pylist() == [0, 1, 2]  # passthrough columns come from the input file
    assert json.loads((tmp_path / "out" / "_SUCCESS.part-00000").read_text()) == record


def test_bad_inputs_are_named_before_any_ray_work(tiny_model_dir, tmp_path):
    def spec_for(inp, **extra):
        return load_spec(None, [f"model={tiny_model_dir}", f"input.path={inp}", f"output.dir={tmp_path / 'o'}",
                                *[f"{k}={v}" for k, v in extra.items()]])

    inp = write_corpus(tmp_path / "corrupt", rows=4)
    (inp / "part-00001.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(SpecError, match=r"part-00001\.parquet: not a readable Parquet file"):
        inspect_inputs(spec_for(inp))

    inp = write_corpus(tmp_path / "nocol", rows=4)
    pq.write_table(pa.table({"text": ["a"], "ref": ["b"], "n": [1]}), inp / "part-00002.parquet")
    with pytest.raises(SpecError, match=r"part-00002\.parquet: no column 'src' \(input\.text_column\)"):
        inspect_inputs(spec_for(inp))

    inp = write_corpus(tmp_path / "wrongtype", rows=4)
    pq.write_table(pa.table({"src": [1, 2], "ref": ["a", "b"], "n": [1, 2]}), inp / "part-00001.parquet")
    with pytest.raises(SpecError, match=r"part-00001\.parquet: column 'src' \(input\.text_column\) must be string, got int64"):
        inspect_inputs(spec_for(inp))

    inp = write_corpus(tmp_path / "noid", rows=4)
    with pytest.raises(SpecError, match=r"part-00000\.parquet: no column 'key' \(input\.id_column\)"):
        inspect_inputs(spec_for(inp, **{"input.id_column": "key"}))
    with pytest.raises(SpecError, match=r"input\.path: .*missing.* does not exist"):
        inspect_inputs(spec_for(tmp_path / "missing"))
    with pytest.raises(SpecError, match="input.path: no files match"):
        inspect_inputs(spec_for(tmp_path / "nothing-*.parquet"))
    pq.write_table(pa.table({"src": ["a"], "status": ["x"]}), tmp_path / "clash.parquet")
    with pytest.raises(SpecError, match=r"clash\.parquet: column 'status' clashes"):
        inspect_inputs(spec_for(tmp_path / "clash.parquet"))


def test_spec_fields_overrides_and_paths(tiny_model_dir, tmp_path, monkeypatch):
    (tmp_path / "jobs").mkdir()
    spec_file = write_spec(tmp_path / "jobs" / "job.toml", tiny_model_dir, Path("data"), Path("../out"),
                           decode={"draft_cap": "8"})
    spec = load_spec(spec_file)
    assert spec.input.path == str(tmp_path / "jobs" / "data")  # relative to the spec file
    assert spec.output.dir == str(tmp_path / "out")
    assert spec.method == "iad" and spec.decode.draft_cap == 8
    monkeypatch.chdir(tmp_path)
    spec = load_spec(spec_file, ["output.dir=elsewhere", "resources.cpus_per_actor=0.25", "decode.adaptive_draft=true",
                                 "kind=translate"])
    assert spec.output.dir == str(tmp_path / "elsewhere")  # relative to the current directory
    assert spec.resources.cpus_per_actor == 0.25 and spec.method == "greedy"
    assert spec.unused_options == ("adaptive_draft", "draft_cap")  # IAD's options, ignored by greedy
    for override, message in [("decode.method=foo", "decode.method: must be one of greedy, beam, iad.*; got 'foo'"),
                              ("decode.method=gad", "decode.drafter: method 'gad' needs a drafter"),
                              ("decode.beems=2", "decode.beems: unknown option"),
                              ("decode.max_batch_size=0", "decode.max_batch_size: must be >= 1"),
                              ("batching.max_batch_size=8", "batching.max_batch_size: moved to decode.max_batch_size"),
                              ("resources.actors=two", "resources.actors: must be int"),
                              ("kind=summarize", "kind: must be one of correct, translate, distill"),
                              ("model=/nonexistent", "model: /nonexistent is not a model directory")]:
        with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_spec(spec_file, [override])


def test_decode_table_is_the_method_options(tiny_model_dir, tmp_path):
    from aggdec.api import decode_options
    from jobs.spec import from_dict

    spec = load_spec(None, [f"model={tiny_model_dir}", "input.path=x", f"output.dir={tmp_path}", "decode.method=iad",
                            "decode.draft_cap=8", "decode.max_batch_size=16", "decode.max_len_a=2"])
    assert spec.decode == decode_options("iad", draft_cap=8, max_batch_size=16, max_len_a=2.0)
    assert from_dict(spec.to_dict()).decode == spec.decode  # the manifest's spec reads back


def test_actor_plans_fit_every_actor_on_one_node():
    one_node = plan_actors([{"CPU": 2.0}])
    assert (one_node.actors, one_node.num_cpus, one_node.torch_threads, one_node.device) == (2, 1.0, 1, "cpu")
    three = plan_actors([{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 1.0}])  # never a reservation split across nodes
    assert (three.actors, three.num_cpus) == (3, 1.0)
    mixed = plan_actors([{"CPU": 4.0}, {"CPU": 3.0}, {"CPU": 1.0}], torch_threads=2)
    assert (mixed.actors, mixed.num_cpus, mixed.torch_threads) == (3, 2.0, 2)  # 2 + 1 + 0 actors
    with pytest.raises(ValueError, match="resources.actors: 4 actors do not fit"):
        plan_actors([{"CPU": 1.0}] * 3, actors=4)
    with pytest.raises(ValueError, match="resources.cpus_per_actor: an actor needs 4 CPUs on one node"):
        plan_actors([{"CPU": 2.0}, {"CPU": 2.0}], cpus_per_actor=4)
    gpu = plan_actors([{"CPU": 8.0, "GPU": 2.0}, {"CPU": 8.0, "GPU": 2.0}], gpus_per_actor=1)
    assert (gpu.actors, gpu.num_gpus, gpu.device, gpu.num_cpus) == (4, 1, "cuda", 1.0)
    mixed = [{"CPU": 4.0}, {"CPU": 8.0, "GPU": 2.0}]  # gpus_per_actor unset: one actor per GPU where there are GPUs
    assert plan_actors(mixed) == plan_actors(mixed, gpus_per_actor=1)
    assert plan_actors(mixed, gpus_per_actor=0).device == "cpu" and one_node.device == "cpu"
    with pytest.raises(ValueError, match="resources.gpus_per_actor: .*0 GPUs"):
        plan_actors([{"CPU": 8.0}], gpus_per_actor=1)
    kwargs = one_node.map_batches_kwargs()
    assert kwargs["compute"].min_size == kwargs["compute"].max_size == 2
    assert kwargs["max_restarts"] == 0 and kwargs["max_task_retries"] == 0


def test_units_cut_large_files_at_fixed_rows(tmp_path):
    from jobs.units import plan_units

    inp = write_corpus(tmp_path / "in", shards=2, rows=10)
    shards = inspect_inputs(load_spec(None, ["model=x", f"input.path={inp}", f"output.dir={tmp_path}"],
                                      check_model=False))
    units = plan_units(shards, 4)
    assert [u.name for u in units[:3]] == ["part-00000.rows-0000000000-0000000004",
                                           "part-00000.rows-0000000004-0000000008",
                                           "part-00000.rows-0000000008-0000000010"]
    assert [(u.start, u.stop) for u in units] == [(0, 4), (4, 8), (8, 10)] * 2
    assert [u.name for u in plan_units(shards, 10)] == ["part-00000", "part-00001"]
    assert units[0].identity["footer_sha"] == dict(shards[0].identity)["footer_sha"]
    assert sorted(u.name for u in units) == [u.name for u in units]  # names sort in input order

    # content hashes: the actor's (open_slice) and the rerun's (slice_contents, each row group read once) agree
    from jobs.units import open_slice, slice_contents

    read = []
    for u in units:
        with open_slice(u) as sl:
            read.append((sl.content, sl.bytes))
    contents = slice_contents(units)
    assert contents == [c for c, _ in read] and contents[0].startswith("sha256:")
    assert len(set(contents)) == 2 and all(n > 0 for _, n in read)  # one row group per file here
    (inp / "part-00001.parquet").unlink()
    assert slice_contents(units)[:3] == contents[:3] and slice_contents(units)[3:] == [None] * 3


def test_small_files_are_packed_into_units_committed_once_and_recomputed_where_one_changed(ray_local, tiny_model_dir,
                                                                                         tmp_path):
    """300 files of 2 rows, packed by `batching.pack_rows` 64 into 10 units of 32 files (the last of 12):
    10 outputs, every row once with its own file's id; a run stopped midway (a pack's record lost, another's
    output gone) reruns those packs only; a changed file recomputes its pack and nothing else."""
    from jobs.units import plan_units

    inp = write_corpus(tmp_path / "in", shards=300, rows=2, seed=6)
    out = tmp_path / "out"
    spec = load_spec(None, [f"model={tiny_model_dir}", f"input.path={inp}", f"output.dir={out}", "input.id_column=none",
                            "decode.method=greedy", "batching.pack_rows=64"])
    units = plan_units(inspect_inputs(spec), 4096, 64)
    assert [len(u.members) for u in units] == [32] * 9 + [12] and units[1].name == "part-00032.pack-32"
    assert [u.name for u in plan_units(inspect_inputs(spec), 4096, 0)][:2] == ["part-00000", "part-00001"]

    result = run_job(spec)
    table = read_outputs(out)
    ids = [f"part-{k:05d}:{i}" for k in range(300) for i in range(2)]
    assert result.rows == table.num_rows == 600 and table.column("id").to_pylist() == ids
    assert table.column("n").to_pylist() == list(range(600))  # passthrough, in input order
    assert len(list(out.glob("*.parquet"))) == len(list(out.glob("_SUCCESS.*"))) == 10
    record = json.loads((out / "_SUCCESS.part-00032.pack-32").read_text())
    assert [m["path"] for m in record["members"]] == [str(inp / f"part-{k:05d}.parquet") for k in range(32, 64)]
    ref = in_process(tiny_model_dir, table.column("src").to_pylist(), spec)
    assert table.column("hyp").to_pylist() == [r.text for r in ref]

    (out / "_SUCCESS.part-00064.pack-32").unlink()  # stopped after the output, before the record
    (out / "part-00096.pack-32.parquet").unlink()  # and before another pack's output
    rerun = run_job(spec)
    assert sorted(rerun.committed) == ["part-00064.pack-32", "part-00096.pack-32"] and rerun.decoded_rows == 128
    again = read_outputs(out)
    assert again.column("id").to_pylist() == ids and again.column("hyp").to_pylist() == table.column("hyp").to_pylist()

    changed = pq.read_table(inp / "part-00200.parquet")
    pq.write_table(changed.set_column(0, "src", pa.array(["the cat sat on the mat .", "a dog ran ."])),
                   inp / "part-00200.parquet")
    third = run_job(spec)
    assert third.committed == ["part-00192.pack-32"] and third.decoded_rows == 64
    final = read_outputs(out)
    assert final.column("id").to_pylist() == ids and final.column("src").to_pylist()[400:402] == [
        "the cat sat on the mat .", "a dog ran ."]


def test_cli_run(ray_local, tiny_model_dir, tmp_path):
    from click.testing import CliRunner

    from cli import main

    inp = write_corpus(tmp_path / "in", shards=2, rows=5, seed=4)
    spec = write_spec(tmp_path / "job.toml", tiny_model_dir, inp, tmp_path / "unused")
    out = tmp_path / "cli-out"
    res = CliRunner().invoke(main, ["run", str(spec), "--output", str(out), "--method", "greedy",
                                    "--set", "decode.max_tokens=256"])
    assert res.exit_code == 0, res.output
    assert "10 rows (" in res.stdout and f"output {out}" in res.stdout and "sentences/s" in res.stdout
    assert read_outputs(out).num_rows == 10
    assert ray.is_initialized()  # the CLI joined the running Ray and left it running

    res = CliRunner().invoke(main, ["run", str(spec), "--set", "decode.method=foo"])
    assert res.exit_code != 0 and "decode.method: must be one of greedy, beam, iad" in res.output
    assert "got 'foo'" in res.output
    (inp / "part-00001.parquet").write_bytes(b"garbage")
    res = CliRunner().invoke(main, ["run", str(spec), "--output", str(tmp_path / "never")])
    assert res.exit_code != 0 and "part-00001.parquet: not a readable Parquet file" in res.output
    assert not (tmp_path / "never").exists()


def test_submit_entrypoint_and_runtime_env(tmp_path):
    # No Jobs API server here (the dashboard needs aiohttp): check what would be sent, and that a bad
    # spec is refused before any connection is attempted.
    from click.testing import CliRunner

    from cli import main
    from cluster import jobs_api

    cmd = jobs_api.entrypoint("examples/correct.toml", ["--set", 'output.dir="/mnt/out dir"'])
    assert cmd == "python -m cli run examples/correct.toml --set 'output.dir=\"/mnt/out dir\"'"
    env = jobs_api.runtime_env(["torch>=2.2"])
    assert env["working_dir"] == str(REPO) and ".git" in env["excludes"] and env["pip"] == ["torch>=2.2"]
    res = CliRunner().invoke(main, ["submit", str(REPO / "examples" / "correct.toml"), "--address", "http://127.0.0.1:1",
                                    "--output", "s3://bucket/out", "--set", "decode.method=nope"])
    assert res.exit_code != 0 and "decode.method: must be one of" in res.output


def test_cluster_configs_parse():
    yaml = pytest.importorskip("yaml")
    launcher = yaml.safe_load((REPO / "cluster" / "ray-cluster-gpu.yaml").read_text())
    assert launcher["cluster_name"] and launcher["head_node_type"] in launcher["available_node_types"]
    assert any(t.get("resources", {}).get("GPU") for t in launcher["available_node_types"].values())
    cluster = yaml.safe_load((REPO / "cluster" / "kuberay" / "raycluster.yaml").read_text())
    assert cluster["kind"] == "RayCluster"
    workers = cluster["spec"]["workerGroupSpecs"]
    limits = workers[0]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert "nvidia.com/gpu" in limits
    job = yaml.safe_load((REPO / "cluster" / "kuberay" / "rayjob.yaml").read_text())
    assert job["kind"] == "RayJob" and "-m cli run" in job["spec"]["entrypoint"]
    assert "working_dir" in yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    assert "nvidia.com/gpu" in job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"]


def test_a_resumed_job_refuses_a_changed_output_option(ray_local, tiny_model_dir, tmp_path):
    from aggdec import checkpoint
    from aggdec.model.heads import ProposalHeads

    heads = tmp_path / "heads"
    bundle = checkpoint.load(tiny_model_dir)
    checkpoint.save_heads(heads, ProposalHeads(bundle.model.cfg.d_model, 3, 16), {"verifier_sha": bundle.sha})
    inp = write_corpus(tmp_path / "in", shards=2, rows=6)
    out = tmp_path / "out"
    base = [f"model={tiny_model_dir}", f"input.path={inp}", f"output.dir={out}", "decode.method=blockwise",
            f"decode.drafter={heads}", "batching.rows_per_task=6"]
    first = run_job(load_spec(None, base))
    assert first.decoded_rows == 12
    # a lossy acceptance option changes the output: refused, naming the option, nothing mixed
    with pytest.raises(SpecError, match=r"decode\.min_block: 0 there, 2 in this job"):
        run_job(load_spec(None, [*base, "decode.min_block=2"]))
    with pytest.raises(SpecError, match=r"decode\.accept: 'exact' there, 'top3-tauinf' in this job"):
        run_job(load_spec(None, [*base, "decode.top_k_accept=3"]))
    # batching cannot change an output: the committed shards are reused
    again = run_job(load_spec(None, [*base, "decode.max_batch_size=2"]))
    assert again.decoded_rows == 0 and len(again.skipped) == 2


def test_damaged_data_fails_one_unit_and_the_others_commit(ray_local, tiny_model_dir, tmp_path):
    inp = write_corpus(tmp_path / "in", shards=2, rows=20, seed=13)
    bad = inp / "part-00001.parquet"
    pq.write_table(pa.table({"src": synthetic_sentences(40, seed=14), "ref": ["r"] * 40, "n": list(range(40))}), bad,
                   row_group_size=20, compression="snappy")
    chunk = pq.ParquetFile(bad).metadata.row_group(1).column(0)
    data = bytearray(bad.read_bytes())
    for i in range(chunk.data_page_offset, chunk.data_page_offset + 16):  # a page header, not the footer
        data[i] ^= 0x5A
    bad.write_bytes(data)
    weird = tmp_path / "in" / "part-00002.parquet"  # invalid UTF-8 in the text column
    raw = pa.array([b"the cat runs .", b"bad \xff\xfe bytes ."], pa.binary())
    pq.write_table(pa.table({"src": pa.Array.from_buffers(pa.string(), 2, raw.buffers()), "ref": ["a", "b"],
                             "n": [100, 101]}), weird)
    out = tmp_path / "out"
    spec = load_spec(None, [f"model={tiny_model_dir}", f"input.path={inp}", f"output.dir={out}",
                            "decode.method=greedy", "batching.rows_per_task=20"])
    with pytest.raises(SpecError, match=r"part-00001\.parquet: row group 1 \(rows 20-40\): cannot be read"):
        run_job(spec)
    names = sorted(p.name for p in out.glob("*.parquet"))
    assert names == ["part-00000.parquet", "part-00001.rows-0000000000-0000000020.parquet", "part-00002.parquet"]
    table = pq.read_table(out / "part-00002.parquet")
    assert table.column("status").to_pylist() == ["ok", "invalid_utf8"]
    assert not json.loads((out / "_manifest.json").read_text())["complete"]


def test_a_large_file_commits_and_resumes_unit_by_unit(ray_local, tiny_model_dir, tmp_path):
    inp = write_corpus(tmp_path / "in", shards=1, rows=12, seed=15)
    out = tmp_path / "out"
    spec = load_spec(None, [f"model={tiny_model_dir}", f"input.path={inp}", f"output.dir={out}",
                            "decode.method=greedy", "batching.rows_per_task=4"])
    first = run_job(spec)
    assert len(first.committed) == 3 and first.decoded_rows == 12
    (out / "_SUCCESS.part-00000.rows-0000000004-0000000008").unlink()  # as if killed before this commit
    again = run_job(spec)
    assert again.committed == ["part-00000.rows-0000000004-0000000008"] and again.decoded_rows == 4
    table = pa.concat_tables(pq.read_table(p) for p in sorted(out.glob("*.parquet")))
    assert table.column("n").to_pylist() == list(range(12))
    assert table.column("id").to_pylist() == [f"part-00000:{i}" for i in range(12)]

    # cut differently, after a run stopped between a unit's output and its record: every file of the
    # old cut goes (the record-less one by its footer), so a reader of the directory sees each row once
    (out / "_SUCCESS.part-00000.rows-0000000008-0000000012").unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recut = run_job(load_spec(None, [f"model={tiny_model_dir}", f"input.path={inp}", f"output.dir={out}",
                                         "decode.method=greedy", "batching.rows_per_task=12"]))
    assert recut.committed == ["part-00000"]
    assert not [w for w in caught if "concurrent actors" in str(w.message)]  # one unit, one actor (of 2 CPUs)
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith("_")) == ["part-00000.parquet"]
    assert sorted(pq.read_table(out).column("n").to_pylist()) == list(range(12))
    manifest = json.loads((out / "_manifest.json").read_text())
    assert "part-00000.rows-0000000008-0000000012.parquet" in manifest["run"]["stale_outputs_deleted"]
    # a Parquet file no job wrote is left alone, and named
    pq.write_table(pa.table({"x": [1]}), out / "notes.parquet")
    warned: list[str] = []
    assert run_job(load_spec(None, [f"model={tiny_model_dir}", f"input.path={inp}", f"output.dir={out}",
                                    "decode.method=greedy", "batching.rows_per_task=12"]), warn=warned.append).skipped
    assert (out / "notes.parquet").exists()
    assert warned == ["warning: output.dir: 1 Parquet file(s) that no aggdec job wrote (notes.parquet); readers of "
                      "the directory see their rows too"]


def test_a_damaged_id_column_fails_its_unit_and_the_others_commit(ray_local, tiny_model_dir, tmp_path):
    from click.testing import CliRunner

    from cli import main

    inp = write_corpus(tmp_path / "in", shards=2, rows=8, seed=16)
    bad = inp / "part-00001.parquet"
    pq.write_table(pa.table({"src": synthetic_sentences(16, seed=17), "id": [f"row{i}" for i in range(16)]}), bad,
                   row_group_size=8, compression="snappy")
    pq.write_table(pa.table({"src": synthetic_sentences(8, seed=16), "id": [f"a{i}" for i in range(8)]}),
                   inp / "part-00000.parquet")
    chunk = pq.ParquetFile(bad).metadata.row_group(1).column(1)  # the id column's data page of row group 1
    assert chunk.path_in_schema == "id"
    data = bytearray(bad.read_bytes())
    for i in range(chunk.data_page_offset, chunk.data_page_offset + 16):
        data[i] ^= 0x5A
    bad.write_bytes(data)
    with pytest.raises((OSError, pa.ArrowException)):
        pq.read_table(bad, columns=["id"])  # the damage is real
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["run", "--model", str(tiny_model_dir), "--input", str(inp), "--output", str(out),
                                    "--method", "greedy", "--set", "input.id_column=id",
                                    "--set", "batching.rows_per_task=8"])
    assert res.exit_code == 2, res.output
    last = res.output.strip().splitlines()[-1]
    assert last.startswith(f"aggdec: error: {bad}: row group 1 (rows 8-16): cannot be read"), res.output
    assert "the other 2 unit(s) committed" in last
    assert sorted(p.name for p in out.glob("*.parquet")) == ["part-00000.parquet",
                                                             "part-00001.rows-0000000000-0000000008.parquet"]
    table = pq.read_table(out)  # as any Parquet reader sees the output directory
    assert sorted(table.column("id").to_pylist()) == sorted([f"a{i}" for i in range(8)] + [f"row{i}" for i in range(8)])


def test_hidden_input_files_are_named_or_decoded_under_visible_names(ray_local, tiny_model_dir, tmp_path):
    from jobs.preflight import check_job

    inp = tmp_path / "in"
    inp.mkdir()
    names = ["part-0.parquet", ".hidden.parquet", "_under.parquet", "..parquet"]
    for k, name in enumerate(names):
        pq.write_table(pa.table({"src": synthetic_sentences(2 + k, seed=20 + k), "n": list(range(10 * k, 10 * k + 2 + k))}),
                       inp / name)
    rows = sum(2 + k for k in range(len(names)))
    # a directory keeps skipping them, as Parquet readers do, and says so naming them
    warnings: list[str] = []
    shards = check_job(load_spec(None, [f"model={tiny_model_dir}", f"input.path={inp}", f"output.dir={tmp_path / 'o1'}"]),
                       warn=warnings.append)
    assert [s.stem for s in shards] == ["part-0"]
    assert any("skipping 3 hidden file(s)" in w and "..parquet, .hidden.parquet, _under.parquet" in w
               for w in warnings), warnings
    # a glob that matches them decodes them under names readers see
    out = tmp_path / "out"
    spec = load_spec(None, [f"model={tiny_model_dir}", f"input.path={inp}/*.parquet", f"output.dir={out}",
                            "decode.method=greedy", "batching.pack_rows=0"])
    result = run_job(spec)
    assert result.rows == rows
    assert sorted(p.name for p in out.glob("*.parquet")) == [
        "hidden-..parquet", "hidden-.hidden.parquet", "hidden-_under.parquet", "part-0.parquet"]
    table = pq.read_table(out)  # a reader of the output directory sees every input row
    assert sorted(table.column("n").to_pylist()) == sorted(n for k in range(4) for n in range(10 * k, 10 * k + 2 + k))


def _waiting_worker(release: Path) -> type:
    """A DecodeWorker that decodes only once `release` exists (shipped by value to the actors)."""
    from cluster.actors import DecodeWorker

    class Waiting(DecodeWorker):
        def __call__(self, batch):
            import time

            while not release.exists():
                time.sleep(0.05)
            return super().__call__(batch)

    return Waiting


def test_one_job_per_output_location(ray_local, tiny_model_dir, tmp_path, monkeypatch):
    import socket
    import subprocess
    import sys
    import threading
    import time

    from jobs.lease import LEASE_NAME, Lease, LeaseHeld
    from jobs.preflight import check_job
    from jobs.storage import Location

    inp = write_corpus(tmp_path / "in", shards=2, rows=3, seed=18)
    out = tmp_path / "out"
    spec = load_spec(None, [f"model={tiny_model_dir}", f"input.path={inp}", f"output.dir={out}",
                            "decode.method=greedy", "resources.actors=1", "batching.pack_rows=0"])
    release = tmp_path / "release"
    monkeypatch.setattr("cluster.actors.DecodeWorker", _waiting_worker(release))
    first: dict = {}
    job = threading.Thread(target=lambda: first.update(r=run_job(spec)))
    job.start()
    deadline = time.time() + 60
    while not (out / LEASE_NAME).exists() and time.time() < deadline:
        time.sleep(0.05)
    inflight = out / ".part-00000.parquet.tmp"  # as if the first job were writing it
    inflight.write_bytes(b"half")
    me = f"pid {os.getpid()} on {socket.gethostname()}, started "
    try:
        for attempt in (lambda: run_job(spec), lambda: check_job(spec)):
            with pytest.raises(LeaseHeld, match=rf"^output\.dir: {re.escape(str(out))} is in use by another job \({me}.*"
                                                r"last heartbeat \d+ s ago\).*--take-over-lease$"):
                attempt()
        assert inflight.exists()  # the refused job deleted nothing
    finally:
        release.touch()
        job.join(timeout=120)
    assert first["r"].decoded_rows == 6 and not (out / LEASE_NAME).exists()  # released when done

    # a stale lease (heartbeat an hour old, another host; or a process of this host that is gone) is taken over
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    now = time.time()
    for host, pid, beat in (("other-host", 1, now - 3600), (socket.gethostname(), int(dead.stdout), now)):
        (out / LEASE_NAME).write_text(json.dumps({"host": host, "pid": pid, "started_at": beat, "heartbeat_at": beat,
                                                  "token": "old"}))
        notes: list[str] = []
        check_job(spec, warn=notes.append)
        assert any(n.startswith("note: output.dir: taking over the lease of a stale job") for n in notes), notes
        logged: list[str] = []
        again = run_job(spec, log=logged.append)
        assert again.decoded_rows == 0 and any(f"pid {pid} on {host}" in m for m in logged)
        assert not (out / LEASE_NAME).exists()
    # a live holder on another host is refused until taken over on purpose
    (out / LEASE_NAME).write_text(json.dumps({"host": "other-host", "pid": 1, "started_at": now,
                                              "heartbeat_at": time.time(), "token": "live"}))
    with pytest.raises(LeaseHeld, match="pid 1 on other-host"):
        run_job(spec)
    assert run_job(spec, take_over_lease=True).decoded_rows == 0

    # of jobs that start together, exactly one takes the lease
    loc = Location(str(tmp_path / "race"))
    won, leases = [], [Lease(loc) for _ in range(8)]

    def take(lease):
        try:
            lease.acquire()
            won.append(lease)
        except LeaseHeld:
            pass

    threads = [threading.Thread(target=take, args=(lease,)) for lease in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1
    # the heartbeat notices a lease overwritten by another job (object stores: a race lost late)
    monkeypatch.setattr("jobs.lease.HEARTBEAT_S", 0.05)
    held = Lease(Location(str(tmp_path / "beat")))
    held.acquire()
    (tmp_path / "beat" / LEASE_NAME).write_text(json.dumps({"host": "other-host", "pid": 7, "started_at": now,
                                                           "heartbeat_at": time.time(), "token": "theirs"}))
    deadline = time.time() + 10
    while not held.lost and time.time() < deadline:
        time.sleep(0.02)
    assert held.lost and "taken over by another job (pid 7 on other-host" in held.lost
    held.release()
    assert (tmp_path / "beat" / LEASE_NAME).exists()  # theirs: left alone
    won[0].release()


def _raising_worker() -> type:
    """A DecodeWorker whose task raises (shipped by value to the actors)."""
    from cluster.actors import DecodeWorker

    class Raising(DecodeWorker):
        def __call__(self, batch):
            raise ValueError("a bug in the task\nsecond line")

    return Raising


def test_io_errors_mid_job_fail_their_unit_by_name_and_the_others_commit(ray_local, tiny_model_dir, tmp_path,
                                                                         monkeypatch):
    from click.testing import CliRunner

    from cli import main

    inp = write_corpus(tmp_path / "in", shards=4, rows=3, seed=21)
    out = tmp_path / "out"
    spec = load_spec(None, [f"model={tiny_model_dir}", f"input.path={inp}", f"output.dir={out}",
                            "decode.method=greedy", "resources.actors=1", "batching.pack_rows=0"])

    warned: list[str] = []

    def after_the_checks(msg: str) -> None:  # the plan line: one input goes, another is rewritten
        warned.append(msg)
        if msg.startswith("decoding "):
            (inp / "part-00001.parquet").unlink()
            pq.write_table(pa.table({"src": ["a b ."], "ref": ["x"], "n": [0]}), inp / "part-00002.parquet")

    with pytest.raises(SpecError) as err:
        run_job(spec, warn=after_the_checks)
    text = str(err.value)
    assert "\n" not in text and len(warned) == 1, (text, warned)  # not taken for a lost actor: no rerun
    gone = rf"{re.escape(str(inp / 'part-00001.parquet'))}: unit part-00001: cannot be read \(.*No such file"
    changed = (rf"{re.escape(str(inp / 'part-00002.parquet'))}: unit part-00002: the file changed since the job "
               r"started \(size \d+ then, \d+ now")
    assert re.match(rf"({gone}|{changed}).*\(and 1 more unit\(s\)\); the other 2 unit\(s\) committed", text), text
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["run"]["attempts"] == 1 and not manifest["complete"]
    assert set(manifest["run"]["failed"]) == {"part-00001", "part-00002"}
    assert sorted(p.name for p in out.glob("*.parquet")) == ["part-00000.parquet", "part-00003.parquet"]

    # a write that fails (here: a directory where the unit's file goes; root can write anywhere else)
    inp = write_corpus(tmp_path / "in2", shards=3, rows=3, seed=22)
    out = tmp_path / "out2"
    (out / "part-00001.parquet").mkdir(parents=True)
    res = CliRunner().invoke(main, ["run", "--model", str(tiny_model_dir), "--input", str(inp), "--output", str(out),
                                    "--method", "greedy", "--set", "input.id_column=n",
                                    "--set", "batching.pack_rows=0"])
    assert res.exit_code == 2, res.output
    assert "lost a" not in res.output and "ERROR" not in res.output, res.output
    last = res.output.strip().splitlines()[-1]
    assert re.fullmatch(rf"aggdec: error: {re.escape(str(out / 'part-00001.parquet'))}: unit part-00001: cannot be "
                        r"written \(.*\); the other 2 unit\(s\) committed, a rerun retries the failed ones", last), last
    assert sorted(p.name for p in out.glob("_SUCCESS.*")) == ["_SUCCESS.part-00000", "_SUCCESS.part-00002"]
    assert not list(out.glob(".*.tmp"))

    # an exception of the task itself is not a lost actor either: raised at once, in one line
    monkeypatch.setattr("cluster.actors.DecodeWorker", _raising_worker())
    with pytest.raises(RuntimeError, match=r"^a decode actor failed: ValueError: a bug in the task$"):
        run_job(load_spec(None, [f"model={tiny_model_dir}", f"input.path={inp}", f"output.dir={tmp_path / 'out3'}",
                                 "decode.method=greedy"]), warn=warned.append)
    assert len(warned) == 2 and json.loads((tmp_path / "out3" / "_manifest.json").read_text())["run"]["attempts"] == 1
