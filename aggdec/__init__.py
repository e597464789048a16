"""aggdec: lossless aggressive decoding for seq2seq models.

Importing aggdec before torch bounds how long torch's OpenMP threads spin while they wait
(`GOMP_SPINCOUNT`, unless the environment sets it): threads that spin through a wait keep the core
from the thread they wait for whenever other processes share the cores, and a decoder that runs
hundreds of parallel regions a second then loses most of its share of a busy machine. The
variable is read once, when torch's OpenMP runtime loads; processes started from this one inherit
it. Where torch was imported first, set it in the environment instead.
"""

import os

SPIN_COUNT = "10000"
"""Spins before a waiting OpenMP thread sleeps (GNU OpenMP's default: 300,000)."""

os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
