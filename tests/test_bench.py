"""The benchmark harness's guarantees (bench/): a peer's process is clean, the names of systems parse or
fail with a reason, a layout search expands and picks its fastest layout, several processes' replies
make one, the documents' tables are regenerated from results files, and a model shape (bench/compare.py)
has the size of the model it stands for."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import record  # noqa: E402
from bench.compare import best_of, identical_share  # noqa: E402
from bench.compare import SHAPES  # noqa: E402
from bench.systems import Process, System, check_clean, layouts, merged, share  # noqa: E402


def test_system_names():
    assert System.parse("iad@int8") == System("iad@int8", "aggdec", "iad", "int8")
    assert System.parse("greedy+compile:models/x") == System("greedy+compile:models/x", "aggdec", "greedy", "fp32",
                                                             True, "models/x")
    assert System.parse("ct2-beam@int8") == System("ct2-beam@int8", "ct2", "beam", "int8")
    assert System.parse("transformers") == System("transformers", "transformers", "greedy", "fp32")
    assert System.parse("transformers@bf16:m") == System("transformers@bf16:m", "transformers", "greedy", "bf16",
                                                         False, "m")
    assert System.parse("ct2@int8/1:models/x") == System("ct2@int8/1:models/x", "ct2", "greedy", "int8", False,
                                                         "models/x", 1)
    assert System.parse("greedy/4").threads == 4 and System.parse("greedy").threads is None
    assert System.parse("gad++") == System("gad++", "aggdec", "gad++", "fp32")  # its "+" is no flag
    assert System.parse("gad+++compile").compile is True and System.parse("gad+++compile").method == "gad++"
    assert System.parse("greedy+auto/2x1").compile == "auto" and System.parse("greedy").compile is False
    for bad, why in (("nope", "unknown method"), ("iad@fp16", "unknown precision"), ("ct2-fast", "not a system"),
                     ("transformers@int8", "unknown precision 'int8' for transformers"),
                     ("fairseq@bf16", "takes no @precision"), ("greedy+fast", "unknown flag"),
                     ("ct2+auto", "takes no \\+auto"),
                     ("ct2/0", "not a thread count"), ("ct2/x", "not a thread count")):
        with pytest.raises(ValueError, match=why):
            System.parse(bad)


def test_layouts_parse_and_a_search_expands_to_every_layout_on_the_cores():
    assert System.parse("ct2@int8/2x1") == System("ct2@int8/2x1", "ct2", "greedy", "int8", threads=1, workers=2)
    assert System.parse("iad@int8/2x1:m") == System("iad@int8/2x1:m", "aggdec", "iad", "int8", False, "m", 1, 2)
    assert System.parse("ct2/1x2").layout(4) == "1x2" and System.parse("ct2/3").layout(4) == "1x3"
    assert System.parse("greedy").layout(2) == "1x2" and System.parse("transformers/1x2").threads == 2
    best = System.parse("ct2@int8/best:models/x")
    assert best.search and best.threads is None and best.workers == 1
    assert layouts(1) == [(1, 1)] and layouts(2) == [(1, 1), (1, 2), (2, 1)]
    assert layouts(4) == [(1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (3, 1), (4, 1)]
    expanded = best.expand(2)
    assert [s.name for s in expanded] == ["ct2@int8/1x1:models/x", "ct2@int8/1x2:models/x", "ct2@int8/2x1:models/x"]
    assert expanded[2] == System("ct2@int8/2x1:models/x", "ct2", "greedy", "int8", False, "models/x", 1, 2,
                                 searched="ct2@int8/best:models/x")
    assert [s.layout(2) for s in System.parse("iad/best").expand(2)] == ["1x1", "1x2", "2x1"]
    assert System.parse("ct2/2x1").expand(2) == [System.parse("ct2/2x1")]
    for bad, why in (("ct2/0x1", "/0x1 is not a thread count"), ("ct2/2x", "/2x is not"), ("iad/bestx", "/bestx"),
                     ("ct2/2x1x1", "/2x1x1 is not"), ("transformers/2x1", "transformers runs on one worker"),
                     ("fairseq/best", "fairseq runs on one worker: /THREADS, not /best")):
        with pytest.raises(ValueError, match=why):
            System.parse(bad)


def test_each_process_decodes_its_contiguous_share_and_the_replies_make_one():
    for n in range(7):
        for parts in (1, 2, 3):
            rows = [list(range(n))[share(n, part, parts)] for part in range(parts)]
            assert sum(rows, []) == list(range(n)) and max(map(len, rows)) - min(map(len, rows)) <= 1
    one = {"seconds": 1.0, "outputs": [[1]], "modules": ["torch"]}
    assert merged([one]) is one
    replies = [{"seconds": 2.0, "outputs": [[1], [2], [3]], "calls_per_sentence": 2.0, "modules": ["torch"]},
               {"seconds": 3.0, "outputs": [[4]], "calls_per_sentence": 6.0, "modules": ["aggdec", "torch"]}]
    assert merged(replies) == {"seconds": 3.0, "outputs": [[1], [2], [3], [4]], "calls_per_sentence": 3.0,
                               "process_seconds": [2.0, 3.0], "modules": ["aggdec", "torch"]}
    failed = merged([replies[0], {"error": "boom", "modules": []}])
    assert failed == {"error": "process 2 of 2: boom", "modules": ["torch"]}


def test_a_search_reports_its_fastest_layout_and_every_layouts_figure():
    head = {"model": "m", "batch_size": 64, "sentences": 10}
    runs = [{**head, "system": "ct2/1x1", "layout": "1x1", "sentences_per_s": 10.0, "identical": 1.0},
            {**head, "system": "ct2/1x2", "layout": "1x2", "error": "refused"},
            {**head, "system": "ct2/2x1", "layout": "2x1", "sentences_per_s": 19.0, "identical": 0.9}]
    assert best_of("ct2/best", runs) == {**head, "system": "ct2/best", "method": "ct2/best", "layout": "2x1",
                                         "sentences_per_s": 19.0, "identical": 0.9, "best": "ct2/2x1",
                                         "layouts": {"1x1": 10.0, "1x2": None, "2x1": 19.0}}
    failed = best_of("ct2/best", [runs[1]])
    assert failed["error"] == "every layout failed; 1x2: refused" and failed["layouts"] == {"1x2": None}


def test_identity_is_taken_under_each_sentences_length_limit():
    """An output cut at its limit equals a peer's that ran one step further; one that ended earlier
    must end at the same token; a difference inside the limit counts."""
    aggdec = [[5, 6, 7], [5, 6], [5, 6, 7], [5]]
    peer = [[5, 6, 7, 8], [5, 6, 9], [5, 6, 8, 8], [5]]
    assert identical_share(aggdec, peer, [3, 3, 3, 4]) == 0.5
    assert identical_share(aggdec, peer, [2, 3, 2, 4]) == 0.75  # a shorter limit: [5, 6] == [5, 6] in row 3
    assert identical_share(aggdec[:1], peer[:1], [3, 3]) == 1.0  # the first n of the limits


@pytest.mark.parametrize("name, parameters", [("opus-mt-shaped", 74_410_496), ("t5-base-shaped", 222_903_552),
                                              ("m2m100-shaped", 483_905_536)])
def test_a_shape_has_the_parameters_of_the_model_it_stands_for(name, parameters):
    """opus-mt-en-de's, t5-base's and m2m100_418M's parameter counts, of the model each shape's config
    makes on the meta device (no weights)."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForSeq2SeqLM.from_config(SHAPES[name].config())
    assert sum(p.numel() for p in model.parameters()) == parameters


def test_a_peer_that_loaded_torch_or_aggdec_is_refused():
    check_clean(System.parse("transformers"), ["torch"])  # transformers needs torch
    check_clean(System.parse("greedy"), ["aggdec", "torch"])
    for name, modules in (("ct2", ["torch"]), ("ct2@int8", ["aggdec"]), ("transformers", ["aggdec", "torch"]),
                          ("fairseq", ["cluster"])):
        with pytest.raises(RuntimeError, match="loaded"):
            check_clean(System.parse(name), modules)


def test_a_ctranslate2_process_loads_neither_torch_nor_aggdec(tmp_path):
    """The process the harness starts for CTranslate2 (here with a model that does not exist, so it
    answers with an error) has imported nothing it must not, whatever the parent imported."""
    import torch  # noqa: F401  (the parent has torch and aggdec loaded)

    import aggdec.api  # noqa: F401

    job = tmp_path / "job.json"
    job.write_text(json.dumps({"kind": "ct2", "ct2_model": str(tmp_path / "missing"), "device": "cpu",
                               "compute": "float32", "threads": 1, "workers": 1, "inputs": [["a"]], "beam": 1,
                               "max_len": 4}))
    process = Process(System.parse("ct2"), job, 1, ROOT)
    try:
        reply = process.request(1, 1)
    finally:
        process.close()
    assert "error" in reply and reply["modules"] == []


def results(path: Path, runs: list[dict]) -> Path:
    path.write_text(json.dumps({"format": record.FORMAT, "kind": "compare", "command": "python -m bench compare",
                                "machine": {"cpu": "CPU X", "cpu_isa": "avx2", "cores": 2, "gpu": None},
                                "versions": {"torch": "2"}, "commit": "abc", "modified": False, "date": "2026-01-01",
                                "settings": {"reference": "greedy", "threads": 2}, "runs": runs}))
    return path


def test_tables_are_regenerated_from_results(tmp_path, monkeypatch):
    runs = [{"model": "m", "system": s, "batch_size": bs, "sentences": 10, "sentences_per_s": v, "identical": same}
            for s, bs, v, same in (("greedy", 1, 10.0, 1.0), ("iad", 1, 30.0, 1.0), ("ct2", 1, 20.0, 0.99),
                                   ("greedy", 64, 100.0, 1.0), ("iad", 64, 150.0, 1.0), ("ct2", 64, 90.0, 0.98))]
    runs.append({"model": "m", "system": "ct2@int8", "batch_size": 1, "sentences": 10, "error": "refused"})
    runs += [{"model": "m", "system": "ct2/best", "batch_size": bs, "sentences": 10, "sentences_per_s": v,
              "identical": 1.0, "layout": layout, "best": f"ct2/{layout}"} for bs, v, layout in ((1, 25.0, "1x1"),
                                                                                            (64, 200.0, "2x1"))]
    table = record.table(record.load(results(tmp_path / "r.json", runs)), ["greedy", "ct2", "ct2@int8", "ct2/best"])
    assert "| m | ct2 | 20.0 (2.00x) | 90.0 (0.90x) | 98% |" in table
    assert "| m | ct2/best | 25.0 (2.50x) at 1x1 | 200.0 (2.00x) at 2x1 | 100% |" in table
    assert "| m | ct2@int8 | failed | — | — |" in table and "iad" not in table
    assert "CPU X (`avx2`, 2 cores), 2 threads" in table
    monkeypatch.setattr(record, "REPO", tmp_path)
    doc = tmp_path / "doc.md"
    marked = "<!-- bench table: {} -->\nold\n<!-- end bench table -->\n"
    doc.write_text("a\n" + marked.format("r.json systems=iad") + "b\n" + marked.format("missing.json"))
    assert record.update(doc) == ["missing.json"]
    text = doc.read_text()
    assert "| m | iad | 30.0 (3.00x) | 150.0 (1.50x) | 100% |" in text and text.count("old") == 1
    assert record.update(doc) == ["missing.json"] and doc.read_text() == text  # regenerating is idempotent
    with pytest.raises(ValueError, match="not a results file"):
        record.load(doc.with_name("r.json").write_text("{}") and doc.with_name("r.json"))


def test_the_roofline_streams_every_weight_of_a_decoder_step_and_no_other():
    """A batch-1 step's weights: per decoder layer self-attention's four products, cross-attention's query
    and output (not its keys and values, which are the encoder's), the feed-forward pair; and the output
    projection (here the shared embedding), each once."""
    from bench.host import step_weights, steps_per_second, tiny

    model = tiny()
    d, ffn, vocab, layers = model.cfg.d_model, model.cfg.dec_ffn, model.cfg.tgt_vocab, model.cfg.dec_layers
    weights = step_weights(model)
    assert sorted(w.numel() for w in weights) == sorted([d * d] * 6 * layers + [d * ffn] * 2 * layers + [vocab * d])
    assert not any(w.data_ptr() == p.data_ptr() for w in weights for p in model.parameters())  # copies
    assert steps_per_second(weights, workers=1, threads=1, seconds=0.05) > 0
