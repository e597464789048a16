"""Corpus jobs: typed TOML specs (spec), storage on any file system (storage), input checks (inputs),
commit units (units), the work of a decode actor on a unit (work, output), the exactly-once output
protocol (commit), the manifest, and the Ray Data pipeline (pipeline, run). Depends on cluster/ and
aggdec/ only."""
