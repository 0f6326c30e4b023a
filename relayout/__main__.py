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
signal.signal(signal.SIGTERM, signal.SIG_DFL)
raise SystemExit(main())
