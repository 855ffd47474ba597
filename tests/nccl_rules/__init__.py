"""NCCL's rules in the test suite: record every `torch.distributed` call a CPU (gloo) rank makes
(`record`), and replay all ranks' records under NCCL's semantics (`replay`).

No test here has a GPU, and gloo forgives what NCCL does not (it matches point-to-point messages
by tag, and runs every operation on its own thread). Every multi-rank test that starts its ranks
with `tests.procs.run_ranks` is recorded and replayed under both of torch's NCCL modes.
"""
