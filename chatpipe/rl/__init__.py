"""RL on verifiable rewards: losses, rewards, rollouts, critic, updates and per-step rollout totals."""
