"""``python -m kvshm.owner NAME``: the owner process clients start on demand."""
import sys

if "--detach" in sys.argv[1:] and not {"-h", "--help"} & set(sys.argv[1:]):
    # Fork before the owner's imports: numpy may start threads, and a fork keeps only one.
    from kvshm.owner.detach import detach
    detach()

from kvshm.owner.command import main  # (after the fork)

sys.exit(main())
