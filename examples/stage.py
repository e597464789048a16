"""aggdec as a stage of a Ray Data pipeline: read the sample corpus with Ray Data, correct it with
models/gec-base and IAD, write Parquet (the rows `aggdec run` writes, without its commit protocol).

    python examples/stage.py [OUT]        # OUT: a new output directory, default out/gec-sample-stage

Joins the cluster in RAY_ADDRESS if set, else starts a local Ray for the run (cluster.connection).
"""

import sys
from pathlib import Path

import ray.data

from cluster.connection import connect, disconnect
from jobs import build_processor

REPO = Path(__file__).resolve().parent.parent


def main(out: str) -> None:
    if Path(out).exists() and any(Path(out).iterdir()):
        sys.exit(f"{out}: exists and is not empty (Ray Data would add files beside the old ones); "
                 "remove it or name another directory")
    processor = build_processor(REPO / "models" / "gec-base", {"method": "iad", "max_batch_size": 64, "draft_cap": 16},
                                text_column="src", id_column="id", batch_size=100)
    conn = connect(quiet=True)
    try:
        ds = ray.data.read_parquet(str(REPO / "examples" / "data" / "gec-sample"))
        processor(ds).write_parquet(out)
    finally:
        disconnect(conn)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(REPO / "out" / "gec-sample-stage"))
