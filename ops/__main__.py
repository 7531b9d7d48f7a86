"""`python -m rlstream producer -c configs/tiny-cpu.yaml` == `rlstream producer -c ...`
(and `torchrun ... -m rlstream consumer -c ...` for a consumer's ranks)."""
import sys

from rlstream.cli import main

if __name__ == "__main__":
    sys.exit(main())
