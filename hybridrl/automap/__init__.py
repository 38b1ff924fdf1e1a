"""Automatic device mapping (HybridFlow Algorithm 1): the step cost model (cost.py), the machines
(hardware.py), one pool's best layout (pools.py), the search over placements and allocations (search.py),
the report of `hybridrl plan --auto` (plan_auto.py; the command is cli/plan.py) and `resources.auto_map` in
`hybridrl train` (apply.py)."""
