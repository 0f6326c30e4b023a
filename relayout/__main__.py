"""``python -m relayout``: SIGTERM and Ctrl-C end even the start-up (imports) with one line and exit 130."""

import signal
import sys


def _interrupted(signum, frame):
    raise KeyboardInterrupt


signal.signal(signal.SIGTERM, _interrupted)
try:
    from .cli import main
except KeyboardInterrupt:
    print("relayout: interrupted while starting", file=sys.stderr)
    raise SystemExit(130) from None
raise SystemExit(main())
