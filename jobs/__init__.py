"""Corpus jobs: TOML job specs (spec), input checks (inputs), the Ray Data pipeline (pipeline),
driver-side assembly and exactly-once commits (assemble, output, commit), the manifest, and
`run.run_job`. Depends on cluster/ and aggdec/, never the other way round."""
