"""Independent random streams keyed by integers: ``(seed, client)``, ``(seed, round, stream)``, ...

A numpy ``SeedSequence`` hashes the key into a 64-bit seed, so nearby keys give unrelated
streams and a stream never depends on the order others were drawn in.
"""

from __future__ import annotations

import numpy as np
import torch


def seeded_generator(*key: int, device: torch.device | str | None = None) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded from the integers ``key``."""
    words = np.random.SeedSequence([int(k) for k in key]).generate_state(2, dtype=np.uint32)
    generator = torch.Generator(device=device) if device is not None else torch.Generator()
    return generator.manual_seed(int(words[0]) << 32 | int(words[1]))
