"""A loop allocates its slot buffers once: through the API, calls of any size (a final chunk, one
sentence) and a switch of methods and back reuse each method's loop, buffers and all."""

from conftest import synthetic_sentences

from aggdec.api import Translator
from aggdec.threads import THREADS


def test_a_translator_allocates_slot_buffers_once_per_method(tiny_model_dir, monkeypatch):
    """Calls of 200, 64, 37, 1 and 64 sentences with greedy, then IAD, then greedy again: each method's
    loop allocates its slots once (`LoopCounters.allocations`), on its first call, and greedy's loop
    still holds its buffers when the calls come back to it; IAD's outputs are greedy's. One loop per
    method: streams (busy cores) would add a loop per stream, each allocating once."""
    monkeypatch.setattr(THREADS, "cores_busy", lambda: False)
    tr = Translator.load(tiny_model_dir)
    sentences = synthetic_sentences(200, seed=11)
    calls = (200, 64, 37, 1, 64)
    texts = {}
    for method in ("greedy", "iad", "greedy"):
        texts.setdefault(method, [])
        for n in calls:
            texts[method].append([r.text for r in tr.translate_batch(sentences[:n], method=method,
                                                                     max_batch_size=64)])
        loops = {key[0].method: loop for key, loop in tr._slot_loops.items()}
        assert loops[method].counters.allocations == 1, method
        assert loops[method].counters.calls > 0
    assert [loop.counters.allocations for loop in tr._slot_loops.values()] == [1, 1]
    assert texts["iad"] == texts["greedy"][:len(calls)] == texts["greedy"][len(calls):]
