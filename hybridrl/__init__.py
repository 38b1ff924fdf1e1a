"""hybridrl: RL post-training for large language models on Megatron-Core (HybridFlow-style)."""
__version__ = "0.1.0"
