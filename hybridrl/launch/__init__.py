"""Multi-node launch helpers: per-node Ray start/stop, waiting for a cluster, and a cluster check.

The Slurm template (launch/slurm/) and the plain Ray scripts (launch/ray/) call these modules on
every node; `hybridrl submit` (submit_cli.py, here) renders and submits the Slurm template.
"""
