"""``python -m agentx``: the ``agentx`` console script."""

import sys

from agentx.cli import main

sys.exit(main())
