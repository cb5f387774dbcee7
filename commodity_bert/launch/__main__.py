import sys

from commodity_bert.launch.launcher import main

sys.exit(main())
