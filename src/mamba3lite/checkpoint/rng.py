"""RNG states as JSON: Python, numpy, torch (CPU) and CUDA, so a resume draws the same numbers."""

from __future__ import annotations

import torch


def capture_rng_state() -> dict:
    """Python, numpy, torch (CPU) and CUDA RNG states as JSON-safe values (byte states in base64)."""
    import base64
    import random

    import numpy as np

    py = random.getstate()
    np_state = np.random.get_state()
    out = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii"),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [
            base64.b64encode(s.numpy().tobytes()).decode("ascii") for s in torch.cuda.get_rng_state_all()
        ]
    return out


def restore_rng_state(state: dict) -> None:
    """Inverse of `capture_rng_state` (a missing entry leaves that generator as it is)."""
    import base64
    import random

    import numpy as np

    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "torch" in state:
        raw = np.frombuffer(base64.b64decode(state["torch"]), dtype=np.uint8).copy()
        torch.set_rng_state(torch.from_numpy(raw))
    if "cuda" in state and torch.cuda.is_available():
        cuda = [
            torch.from_numpy(np.frombuffer(base64.b64decode(s), dtype=np.uint8).copy()) for s in state["cuda"]
        ]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
