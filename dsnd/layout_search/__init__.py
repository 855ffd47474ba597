"""``dsnd plan``: choose a parallel layout before launch.

Pure arithmetic over a model's shape and a device's datasheet: `hardware` (devices and links),
`shape` (a model as the planner sees it), `memory` (model states, activations, buffers per
device), `timing` (one step's time), `search` (every valid layout, ranked and explained),
`emit` (the chosen layout as a run YAML and a DeepSpeed JSON) and `validate` (predicted ÷
measured for layouts run on this machine).
"""
