import sys

from commodity_bert.plan.cli import main

sys.exit(main())
