"""``python -m qcoll.bench``: the same as the ``qcoll-bench`` console script."""
from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
