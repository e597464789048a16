"""Decoding streams: a wide CPU call on busy cores is split over loops of one thread each, and gives
the outputs of one loop (greedy, and IAD equal to it); torch's thread count is restored after."""

import os
import random
import subprocess
import sys
import time

import pytest
import torch
from tiny_models import tiny_model

from aggdec.decoding import streams
from aggdec.decoding.metadata import Request
from aggdec.decoding.method_options import decode_options
from aggdec.decoding.methods import METHODS, DraftContext
from aggdec.model.projection import OutputProjection
from aggdec.threads import THREADS


def test_streams_take_one_thread_each_and_only_where_each_gets_a_batch():
    assert streams.stream_count(2, 64, 1000) == 2
    assert streams.stream_count(4, 64, 1000) == 4 and streams.stream_count(8, 64, 1000) == 4
    assert streams.stream_count(2, 31, 1000) == 1  # a stream's batch would be under MIN_STREAM_BATCH
    assert streams.stream_count(2, 64, 31) == 1  # so would its requests
    assert streams.stream_count(1, 64, 1000) == 1


@pytest.mark.parametrize("method", ["greedy", "iad"])
def test_a_call_in_streams_gives_the_outputs_of_one_loop(method, monkeypatch):
    model = tiny_model("postnorm-sinusoidal-shared", vocab=11)
    rng = random.Random(3)
    reqs = [Request(index=i, src=[rng.randrange(3, 11) for _ in range(rng.randint(1, 12))] + [model.cfg.eos],
                    max_len=rng.randint(1, 25)) for i in range(40)]
    ctx = DraftContext(model, OutputProjection(model.output_weight, certify=False), False, lambda p, b: None)
    before = torch.get_num_threads()
    seen = []
    run = streams.decode_in_streams
    monkeypatch.setattr(streams, "MIN_STREAM_BATCH", 4)

    def in_streams(loops, requests):  # each stream's loop runs with torch on one thread
        return run([lambda part, run=r: seen.append(torch.get_num_threads()) or run(part) for r in loops], requests)

    monkeypatch.setattr("aggdec.decoding.methods.decode_in_streams", in_streams)
    try:
        torch.set_num_threads(3)
        one = METHODS["greedy"].decode(decode_options("greedy", max_batch_size=3), reqs, ctx)
        assert seen == []  # 3 rows: one loop
        procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * os.cpu_count())]
        try:
            time.sleep(0.2)
            split = METHODS[method].decode(decode_options(method, max_batch_size=12), reqs, ctx)
        finally:
            for p in procs:
                p.kill()
                p.wait()
        assert seen == [1, 1, 1] and THREADS.own_threads() == 3
        assert sorted((h.index, h.tokens) for h in split) == sorted((h.index, h.tokens) for h in one)
    finally:
        torch.set_num_threads(before)
