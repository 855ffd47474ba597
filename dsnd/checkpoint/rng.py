"""Every random generator a rank uses, as JSON (torch CPU and CUDA, Python, numpy).

JSON, not pickle: a checkpoint never needs unpickling to load. dsnd's own math draws nothing
random after initialisation (dropout is 0, data order is a function of (seed, step)), but user
code and DeepSpeed may, so a resumed rank continues every stream where it stopped.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def capture() -> dict:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, state, gauss = random.getstate()
    out = {
        "torch": torch.get_rng_state().tolist(),
        "python": [version, list(state), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }
    if torch.cuda.is_available():
        out["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return out


def restore(saved: dict) -> None:
    torch.set_rng_state(torch.tensor(saved["torch"], dtype=torch.uint8))
    version, state, gauss = saved["python"]
    random.setstate((version, tuple(state), gauss))
    kind, keys, pos, has_gauss, cached = saved["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in saved["cuda"]])
