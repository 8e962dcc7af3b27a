"""`python -m radixlm.router [flags]`: the same as `radixlm-router [flags]`."""

import sys

from radixlm.router.cli import main

sys.exit(main(prog="python -m radixlm.router"))
