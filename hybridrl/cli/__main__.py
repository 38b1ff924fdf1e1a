"""`python -m hybridrl.cli ...`: the `hybridrl` command (what Slurm jobs and the tests run)."""
import sys

from hybridrl.cli import main

sys.exit(main())
