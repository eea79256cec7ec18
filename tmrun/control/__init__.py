"""Decisions: the leader of the membership (leader.py, its pure rules in planner.py), in-place
replacement (replacement/: one core, a policy per topology), the job's events and status, and
the "tmrun" rendezvous backend that hands the leader to the rendezvous adapter."""
