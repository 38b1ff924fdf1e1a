"""3D-HybridEngine: the plan (micro-DP groups, strided generation groups), the reshard, the baselines it is
measured against, byte / memory accounting and the projected transition cost. Import the submodules directly:
engine (HybridEngine: the actor's switch, what workers use), plan (HybridEnginePlan, STRATEGIES), accounting
(account, account_all, table2), reshard (Resharder, ShardedParam; the in-place buffer layout and collective
schedule are in inplace.py), megatron_adapter (training_params, generation_pg_collection, load_generation_weights),
model_shapes (model_shapes, PRESETS: Llama and MoE presets), cost_model (transition_time, Hardware). Rank
arithmetic is in hybridrl.parallel.generation."""
