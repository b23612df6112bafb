"""``python -m ckptkit``: the ``ckptkit`` command (and what ``torchrun ... -m ckptkit`` runs on each rank)."""

from .cli import main

if __name__ == "__main__":
    main()
