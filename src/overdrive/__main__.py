import sys

from overdrive.cli import main

sys.exit(main())
