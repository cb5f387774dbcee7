from data_prep.cli import main

raise SystemExit(main())
