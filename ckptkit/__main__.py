"""``python -m ckptkit ...``: the command line, as the ``ckptkit`` console script runs it (also what
``torchrun ... -m ckptkit ...`` starts on every rank)."""

from .cli import main

if __name__ == "__main__":
    main()
