from looplm.cli import main

raise SystemExit(main())
