"""The roles of an RL dataflow as plain Python objects, each a WorkerGroup on a ResourcePool: Actor
(policy + generation through the 3D-HybridEngine), RolloutReplicas (generation on a pool of its own),
ReferencePolicy (also a distillation teacher), Critic, RewardModel (reward model or rule function), Judge (a
generative reward model); roles/sources.py combines reward sources."""
from hybridrl.roles.actor import Actor
from hybridrl.roles.critic import Critic
from hybridrl.roles.judge import Judge, JudgeScores
from hybridrl.roles.reference import ReferencePolicy
from hybridrl.roles.replicas import PendingRollouts, RolloutReplicas, check_rollout_pool
from hybridrl.roles.reward import RewardModel, TextScoring

__all__ = ["Actor", "Critic", "Judge", "JudgeScores", "PendingRollouts", "ReferencePolicy", "RewardModel",
           "RolloutReplicas", "TextScoring", "check_rollout_pool"]
