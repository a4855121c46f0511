"""`python -m lychee_exp.report DIR [--out FILE] [--title T]`: one HTML page comparing the runs and sweeps under DIR
(lychee_exp.tracking.report)."""

import sys

from lychee_exp.tracking.report.html import main

if __name__ == "__main__":
    sys.exit(main())
