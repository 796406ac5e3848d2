"""Deprecated: ``python -m vllm_hawk.tt_plugin --tt-* ... serve ...`` is ``hawk vllm --tt-* ... serve ...``."""

import sys
import warnings

from vllm_hawk.vllm_launcher import main

warnings.warn(
    "python -m vllm_hawk.tt_plugin is deprecated: use hawk vllm --tt-platform ... (vllm_hawk.vllm_launcher)",
    FutureWarning,
    stacklevel=1,
)

if __name__ == "__main__":
    sys.exit(main())
