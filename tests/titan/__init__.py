"""TEST-ONLY support for running torchtitan on CPU (tests/e2e/test_torchtitan.py): a CPU shim for
torchtitan (which has no CPU path of its own), generated offline assets (a JSON-lines text set
and a word-level tokenizer), and a ``--module`` config that trains torchtitan's llama3 debug
model through :mod:`tmrun.integrations.torchtitan` with the tests' probes. Nothing here is
part of tmrun or needed on GPUs."""
