"""`quantkit` as torchrun starts it, except that rank 1 dies (os._exit, as a killed or crashed process would)
when its first solved Linear is applied: tests/test_distributed.py checks what the survivors do."""
import os
import sys

from quantkit.cli import main
from quantkit.pipeline import sequential

real_apply = sequential._Solve.apply


def apply(self, name, qw):
    if os.environ.get("RANK") == "1":
        os._exit(9)
    return real_apply(self, name, qw)


if __name__ == "__main__":
    sequential._Solve.apply = apply
    sys.argv = ["quantkit", *sys.argv[1:]]
    main()
