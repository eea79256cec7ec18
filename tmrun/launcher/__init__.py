"""The tmrun agent and the launch sequence around it."""
