"""Rollout: engines, the router, generators, rewards and the rollout manager."""
