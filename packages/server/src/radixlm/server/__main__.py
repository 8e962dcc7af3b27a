"""`python -m radixlm.server [flags]`: the same as `radixlm serve [flags]`."""

import sys

from radixlm.server.cli import serve_main

sys.exit(serve_main(prog="python -m radixlm.server"))
