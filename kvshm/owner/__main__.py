"""``python -m kvshm.owner NAME``: the owner process clients start on demand."""
import sys

from kvshm.owner.command import main

sys.exit(main())
