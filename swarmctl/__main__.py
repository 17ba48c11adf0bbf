from swarmctl.cli import main

raise SystemExit(main())
