"""Command-line entry points: ``tmrun`` (the launcher) and ``tmrun-ctl`` (operations)."""
