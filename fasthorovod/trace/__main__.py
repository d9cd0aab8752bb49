"""``python -m fasthorovod.trace analyze DIR`` — the same as the ``fasthorovod-trace`` command."""
import sys

from fasthorovod.trace.cli import main

sys.exit(main())
