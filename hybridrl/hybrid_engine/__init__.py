"""3D-HybridEngine: the plan (micro-DP groups, strided generation groups), the baselines it is measured
against, byte / memory accounting and the projected transition cost. Import the submodules directly:
plan (HybridEnginePlan, STRATEGIES), accounting (account, account_all, table2), model_shapes (model_shapes,
LLAMA_PRESETS), cost_model (transition_time, Hardware); rank arithmetic is in hybridrl.parallel.generation."""
