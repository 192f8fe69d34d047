"""``python -m deepshard.kernels``: prints which kernels are compiled and what they run on."""

from __future__ import annotations

import sys

from deepshard.kernels import kernel_report


def main() -> int:
    """Prints the kernel report; returns the exit status (0)."""
    print(kernel_report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
