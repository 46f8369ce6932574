"""Load time and per-rank peak memory: one checkpoint in three layouts, loaded on 1 and N ranks.

    python scripts/bench_load.py --size small --gpus 4 --json load.json
    python scripts/bench_load.py --size gpt-oss --mxfp4
    python scripts/bench_load.py --size deepseek --fp8

Layouts: one monolithic safetensors file; files of at most --max-shard-size; rank-aligned files of at most
--max-shard-size (scripts/shard.py --gpus N). Every load runs in fresh processes, so each peak RSS (VmHWM) is
that rank's own; "above base" subtracts the process's RSS before it read any weight. Prints the median load
time over --repeats runs, and the target the sharding issue sets: weights/N + 15%.
"""

import sys

from moe.cli.bench_load import run

sys.exit(run())
