"""`python -m lychee_exp.report DIR [--out FILE] [--title T] [--overwrite]`: one HTML page comparing the runs and
sweeps under DIR (lychee_exp.tracking.report). --out is never a file the report reads, and an existing file other
than an earlier report page is replaced only with --overwrite (lychee_exp.tracking.report.output)."""

import sys

from lychee_exp.tracking.report.html import main

if __name__ == "__main__":
    sys.exit(main())
