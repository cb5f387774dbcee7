"""`python -m commodity_bert.launcher`, the name older docs and job scripts use: the same as
`bert-launch` (commodity_bert/launch/)."""
import sys

from commodity_bert.launch.launcher import main

if __name__ == "__main__":
    sys.exit(main())
