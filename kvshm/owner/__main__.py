"""``python -m kvshm.owner NAME``: the owner process clients start on demand."""
import sys

from kvshm.owner.command import main  # light: the owner's own imports wait for main's detach()

sys.exit(main())
