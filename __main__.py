"""``python -m dayzero ...`` is the ``dayzero`` command; ``torchrun --nproc-per-node N -m dayzero run ART`` runs a
sharded artifact on N ranks (runtime/dist.py)."""

from dayzero.tools.cli import main

main()
