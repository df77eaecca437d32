"""One module per `opscope` subcommand: each has `add_parser(subparsers)` and `run(args) -> int`.

Commands only parse arguments, call the Python API and print; the work lives in the
library modules so that everything the CLI does is one call from Python.
"""

COMMANDS = ["inject", "record", "analyze", "mine", "report", "rewrite", "parity", "demo"]
