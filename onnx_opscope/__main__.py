"""`python -m onnx_opscope ...` is the `opscope` command."""

import sys

from .cli import main

sys.exit(main())
