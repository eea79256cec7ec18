"""The runtime inside a training process: ``tmrun.init()``, steps, tracking, sandbox, healing."""
