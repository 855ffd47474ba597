"""What a run does, decided before any process starts: partition, schedules, memory.

What a run does, decided before any process starts: which layers each pipeline stage holds
(`partition`, `profile`), what every stage runs in a step (`schedule`), and the `plan` that ties
them to the topology, ZeRO stage and model. Pure: no process groups, no engines.

Submodules are imported by name (``dsnd.plan.schedule``); this package imports nothing itself.
"""
