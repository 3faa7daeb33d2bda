"""`python -m tilecast.cli`: the library's commands (the console script adds the Prefect ones)."""
import sys

from tilecast.cli.main import main

sys.exit(main())
