"""`python -m consumer -c configs/tiny-cpu.yaml` == `rlstream consumer -c ...`."""
import sys

from common.app.cli import main

if __name__ == "__main__":
    sys.exit(main(["consumer", *sys.argv[1:]]))
