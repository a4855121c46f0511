"""`python -m lychee_exp.bench`: the scaling benchmark (lychee_exp.bench.scaling)."""

import sys

from lychee_exp.bench.scaling import main

sys.exit(main())
