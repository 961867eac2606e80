from noloco.cli import main
from noloco.exiting import exit_now

exit_now(main())
