"""`python -m benchmarks`: the scaling benchmark (benchmarks.scaling)."""

import sys

from benchmarks.scaling import main

sys.exit(main())
