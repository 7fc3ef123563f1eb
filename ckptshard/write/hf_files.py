"""The files of a Hugging Face model folder beside its weights: ``config.json`` as planned
(``plan.hf_folder.config_for``) and the others copied byte for byte."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, List, Mapping, Sequence, Tuple

from ..read.hf_config import CONFIG


def write_hf_files(folder: str, config: Mapping[str, Any], carried: Sequence[Tuple[str, str]]) -> List[str]:
    """``config.json`` (as ``save_pretrained`` writes it: indented, keys sorted) and each carried (name, path)
    into ``folder``; their names."""
    with open(os.path.join(folder, CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    for name, path in carried:
        shutil.copyfile(path, os.path.join(folder, name))
    return [CONFIG, *(name for name, _ in carried)]
