"""`python -m phaseserve.scheduler`: run the scheduler service (see scheduler/service.py)."""

import sys

from phaseserve.scheduler.service import main

if __name__ == "__main__":
    sys.exit(main())
