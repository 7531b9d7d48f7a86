"""`python -m producer -c configs/tiny-cpu.yaml` == `rlstream producer -c ...`."""
import sys

from common.app.cli import main

if __name__ == "__main__":
    sys.exit(main(["producer", *sys.argv[1:]]))
