"""RL on verifiable rewards: losses, rewards, rollouts, critic and updates."""
