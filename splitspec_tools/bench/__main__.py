import sys

from .run import cli_main

sys.exit(cli_main())
