"""The Ray Data stage (jobs.stage) on a real local Ray (2 CPUs) with the shipped models/gec-base and
IAD: the README example (read_parquet -> stage -> write_parquet) and a Dataset from_items, outputs
equal to in-process decoding, passthrough columns, bad rows as status rows, a pool of two actors,
the output schema of a job; and what fails at construction or when called, and the actor plans."""

from __future__ import annotations

import dataclasses
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402
import ray._private.state  # noqa: E402
from test_jobs import ray_local  # noqa: E402, F401  (a module fixture: a local Ray of 2 CPUs)

from aggdec.api import Translator  # noqa: E402
from aggdec.decoding.method_options import options_from_mapping  # noqa: E402
from aggdec.decoding.options import OptionError  # noqa: E402
from jobs import build_processor  # noqa: E402
from jobs.run import run_job  # noqa: E402
from jobs.spec import load_spec  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "gec-base"
SAMPLE = REPO / "examples" / "data" / "gec-sample"
OPTIONS = {"method": "iad", "max_batch_size": 64, "draft_cap": 16}  # examples/stage.py's, examples/correct.toml's
COMPARED = ("hyp", "status", "error", "src_len", "hyp_len")  # per-row outputs that do not depend on the batch


@pytest.fixture(scope="module")
def processor():
    return build_processor(MODEL, OPTIONS, text_column="src", id_column="id")


@pytest.fixture(scope="module")
def translator():
    return Translator.load(MODEL)


def decoded_in_process(translator: Translator, texts: list[str]) -> list[dict]:
    results = translator.translate_batch(texts, options_from_mapping(OPTIONS, "greedy")[0])
    return [{"hyp": r.text, "status": r.status, "error": r.error, "src_len": r.src_len, "hyp_len": len(r.tokens)}
            for r in results]


def decode_workers() -> set[str]:
    """Ids of the decode actors this Ray session has started (alive or gone)."""
    return {a["ActorID"] for a in ray._private.state.actors().values()
            if a["ActorClassName"] == "MapWorker(MapBatches(DecodeWorker))"}


def test_example_reads_parquet_decodes_with_iad_and_writes_a_jobs_rows(ray_local, translator, tmp_path):
    # examples/stage.py as written (its main, into a directory of the test's)
    runpy.run_path(str(REPO / "examples" / "stage.py"), run_name="example")["main"](str(tmp_path / "stage"))
    out = pq.read_table(tmp_path / "stage")
    inp = pq.read_table(SAMPLE)
    assert out.num_rows == inp.num_rows == 300
    rows = {r["id"]: r for r in out.to_pylist()}
    assert len(rows) == 300
    expected = decoded_in_process(translator, inp.column("src").to_pylist())
    for source, want in zip(inp.to_pylist(), expected):
        got = rows[source["id"]]
        assert (got["src"], got["ref"], got["method"]) == (source["src"], source["ref"], "iad")
        assert {k: got[k] for k in COMPARED} == want
    assert sum(r["status"] == "ok" for r in rows.values()) == 300

    # the rows of a job: the schema of `aggdec run`'s output over the same columns
    part = tmp_path / "in" / "part.parquet"
    part.parent.mkdir()
    pq.write_table(inp.slice(0, 6), part)
    spec = load_spec(None, [f"model={MODEL}", f"input.path={part.parent}", f"output.dir={tmp_path / 'job'}",
                            "input.id_column=id", "resources.actors=1",
                            *(f"decode.{k}={v}" for k, v in OPTIONS.items())])
    run_job(spec)
    job = pq.read_table(tmp_path / "job" / "part.parquet")
    assert out.schema.remove_metadata().equals(job.schema.remove_metadata())
    by_id = {r["id"]: r for r in job.to_pylist()}
    assert all({k: rows[i][k] for k in COMPARED} == {k: r[k] for k in COMPARED} for i, r in by_id.items())


def test_from_items_with_hooks_bad_rows_and_two_actors(ray_local, translator):
    sample = pq.read_table(SAMPLE).slice(0, 10).to_pylist()
    items = [{"sentence": r["src"], "key": r["id"], "n": i, "tags": ["a"] * (i % 3)} for i, r in enumerate(sample)]
    bad = {"none": None, "int": 5, "bytes": b"caf\xe9 .", "blank": "  "}
    items += [{"sentence": v, "key": k, "n": 100 + i, "tags": []} for i, (k, v) in enumerate(bad.items())]
    ds = ray.data.from_items(items, override_num_blocks=7)
    two = build_processor(MODEL, OPTIONS, text_column="src", id_column="key", actors=2, batch_size=2,
                          preprocess=lambda row: {"src": row.pop("sentence"), **row},
                          postprocess=lambda row: {**row, "words": len(row["hyp"].split())})
    before = decode_workers()
    out = two(ds)
    rows = {r["id"]: r for r in out.take_all()}
    assert len(decode_workers() - before) == 2

    assert len(rows) == len(items)
    expected = decoded_in_process(translator, [r["src"] for r in sample])
    for i, (source, want) in enumerate(zip(sample, expected)):
        got = rows[source["id"]]
        assert (got["src"], got["n"], list(got["tags"]), got["method"]) == (source["src"], i, ["a"] * (i % 3), "iad")
        assert {k: got[k] for k in COMPARED} == want
        assert got["words"] == len(want["hyp"].split())
    assert (rows["none"]["status"], rows["none"]["src"], rows["none"]["hyp"]) == ("empty", None, "")
    assert (rows["int"]["status"], rows["int"]["src"]) == ("error", None)
    assert rows["int"]["error"] == "src: not a string (int)"
    replaced = decoded_in_process(translator, ["caf\ufffd ."])[0]
    assert rows["bytes"]["status"] == "invalid_utf8" and rows["bytes"]["src"] == "caf\ufffd ."
    assert rows["bytes"]["hyp"] == replaced["hyp"]
    assert (rows["blank"]["status"], rows["blank"]["n"]) == ("empty", 103)
    assert list(rows["int"]) == ["id", "src", "hyp", "n", "tags", "status", "error", "method", "src_len", "hyp_len",
                                 "iterations", "drafted", "accepted", "accepted_per_iter", "decode_ms", "words"]


def test_a_missing_or_clashing_column_fails_when_called(ray_local, processor):
    with pytest.raises(ValueError, match=r"^text_column: no column 'src' in the Dataset \(columns: text, id\)$"):
        processor(ray.data.from_items([{"text": "a", "id": "1"}]))
    with pytest.raises(ValueError, match=r"^column 'status' clashes with an output column"):
        processor(ray.data.from_items([{"src": "a", "id": "1", "status": "new"}]))


def test_a_model_that_cannot_load_fails_at_build_processor_in_one_line(tmp_path):
    with pytest.raises(ValueError) as e:
        build_processor(tmp_path / "nowhere", text_column="src")
    assert str(e.value) == f"model: {tmp_path / 'nowhere'}: not a model directory (no config.json)"
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "spm.model"):
        (broken / name).write_bytes((MODEL / name).read_bytes())
    (broken / "model.safetensors").write_bytes((MODEL / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(ValueError) as e:
        build_processor(broken, OPTIONS, text_column="src")
    assert str(e.value).startswith(f"model: {broken / 'model.safetensors'}: cannot read weights")
    assert "\n" not in str(e.value)
    with pytest.raises(OptionError, match=r"^draft_cap: must be >= 1"):
        build_processor(MODEL, {"method": "iad", "draft_cap": 0}, text_column="src")
    with pytest.raises(ValueError, match=r"^options.drafter: .*nowhere"):
        build_processor(MODEL, {"method": "gad", "drafter": str(tmp_path / "nowhere")}, text_column="src")


def test_actor_plans(processor):
    cpu = processor.plan([{"CPU": 2.0}])
    assert (cpu.actors, cpu.num_cpus, cpu.num_gpus, cpu.device, cpu.torch_threads) == (2, 0.5, 0.0, "cpu", 1)
    gpu = processor.plan([{"CPU": 8.0, "GPU": 2.0}, {"CPU": 8.0, "GPU": 1.0}])
    assert (gpu.actors, gpu.num_cpus, gpu.num_gpus, gpu.device) == (3, 1.0, 1.0, "cuda")
    assert processor.plan([{"CPU": 8.0, "GPU": 2.0}]).map_batches_kwargs()["num_gpus"] == 1.0
    assert dataclasses.replace(processor, gpus_per_actor=0).plan([{"CPU": 4.0, "GPU": 1.0}]).device == "cpu"
    with pytest.raises(ValueError, match=r"^cpus_per_actor: 1 actors of 0.5 CPUs leave 0.5 of the cluster's 1 CPUs"):
        processor.plan([{"CPU": 1.0}])
    assert dataclasses.replace(processor, cpus_per_actor=0).plan([{"CPU": 1.0}]).actors == 1
    with pytest.raises(ValueError, match=r"^actors: 5 actors do not fit"):
        dataclasses.replace(processor, actors=5, cpus_per_actor=1).plan([{"CPU": 2.0}])
    with pytest.raises(ValueError, match=r"^gpus_per_actor: 1 GPU\(s\) per actor, but the cluster has 0 GPUs"):
        dataclasses.replace(processor, gpus_per_actor=1).plan([{"CPU": 2.0}])


def test_jobs_imports_ray_only_for_the_stage():
    code = ("import sys, jobs, jobs.spec, jobs.inputs; assert 'ray' not in sys.modules; "
            "from jobs import build_processor; assert 'ray' in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
