import sys

from noloco.cli import main

sys.exit(main())
