"""``python -m agentx.bench synth|run|compare|plot``."""

import sys

from agentx.bench.cli import bench_main

sys.exit(bench_main())
