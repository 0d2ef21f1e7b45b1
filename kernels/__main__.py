"""`python -m kernels`: build the kernels' library (setup.sh runs it)."""

import sys

from kernels.build import main

sys.exit(main())
