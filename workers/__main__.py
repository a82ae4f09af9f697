"""`python -m phaseserve.workers`: run the workers service (see workers/service.py)."""

import sys

from phaseserve.workers.service import main

if __name__ == "__main__":
    sys.exit(main())
