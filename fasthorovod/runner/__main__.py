"""``python -m fasthorovod.runner ARGS`` is ``fasthorovodrun ARGS`` (what --emulate-cloud runs inside the cloud)."""

import sys

from .launch import main

if __name__ == "__main__":  # not when multiprocessing's spawn re-imports this module
    sys.exit(main())
