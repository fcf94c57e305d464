"""`python -m experiments.table1 [--quick] ...`: the Table-1 experiment's command line (run.py's `main`)."""

import sys

from experiments.table1.run import main

if __name__ == "__main__":
    sys.exit(main())
