"""A draft model for measuring draft-model speculation where the family has no smaller member.

SmolLM2-135M is the smallest SmolLM2, and nothing can be downloaded here, so the bench and the
tests draft with the bundled model's first N layers (its own embeddings, final norm and head).
Untrained as a draft, it agrees with the whole model on ~40% of tokens at 24 of 30 layers and
on almost none at 16: good enough to exercise acceptance and rejection, not to speed anything up.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def layer_prefix_model(source: Path, layers: int, target: Path) -> Path:
    """Write the first `layers` decoder layers of the HF checkpoint `source` as a model folder."""
    from safetensors.torch import load_file, save_file

    target.mkdir(parents=True, exist_ok=True)
    state = load_file(str(source / "model.safetensors"))
    kept = {
        name: tensor
        for name, tensor in state.items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers
    }
    save_file(kept, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (target / "config.json").write_text(json.dumps(config, indent=2))
    for extra in source.iterdir():
        if extra.name not in ("model.safetensors", "config.json") and extra.is_file():
            shutil.copy(extra, target / extra.name)
    return target
