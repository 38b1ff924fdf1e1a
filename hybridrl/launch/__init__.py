"""Multi-node launch helpers: per-node Ray start/stop, waiting for a cluster, and a cluster check.

The Slurm template (launch/slurm/) and the plain Ray scripts (launch/ray/) call these modules on
every node; `hybridrl submit` (the command: hybridrl/cli/submit.py) renders the Slurm template with
submit.py, here, and submits it.
"""
