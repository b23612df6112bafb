"""DeepSpeed: its engine's ZeRO checkpoints (read) and its universal checkpoint (read and written).

One idea a module: :mod:`.zero` (a ZeRO 1-3 save's tag directory and files, loaded as data),
:mod:`.zero_partitions` (each parameter and Adam moment located in the ranks' flat partitions),
:mod:`.universal` (the universal checkpoint ``ds_to_universal`` writes) and :mod:`.universal_source` (what a
universal checkpoint is written from). The names other packages use are the ones exported here.
"""

from __future__ import annotations

from .universal import DeepSpeedUniversalIO, UniversalOptions
from .zero import DeepSpeedIO, read_tag, tag_directory

__all__ = ["DeepSpeedIO", "DeepSpeedUniversalIO", "UniversalOptions", "read_tag", "tag_directory"]
